# cmake -DPACKAGE_FIND_VERSION=X.Y -DVERSION_FILE=.../dparallelConfigVersion.cmake -P version_compatible.cmake
# prints (on stderr) TRUE or FALSE: whether find_package(dparallel X.Y) accepts the package.
string(REGEX MATCH "^([0-9]+)" PACKAGE_FIND_VERSION_MAJOR "${PACKAGE_FIND_VERSION}")
include("${VERSION_FILE}")
if(PACKAGE_VERSION_COMPATIBLE AND NOT PACKAGE_VERSION_UNSUITABLE)
  message(NOTICE "TRUE")
else()
  message(NOTICE "FALSE")
endif()
