# cmake -DSRC=<library> -DDST=<file> [-DORIGIN=ON] -P stage_native.cmake
# Copies a built library into a package (the jar, the .nupkg) with the
# run path its installed copy has: $ORIGIN for the JNI and C# glue libraries
# (libdparallel.so.0 lies beside them), none for libdparallel, instead of the
# build tree's.
get_filename_component(_dir ${DST} DIRECTORY)
file(MAKE_DIRECTORY ${_dir})
file(COPY_FILE ${SRC} ${DST})
if(ORIGIN)
  file(RPATH_SET FILE ${DST} NEW_RPATH "$ORIGIN")
else()
  file(RPATH_REMOVE FILE ${DST})
endif()
