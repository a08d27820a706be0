module dparallel.org/dparallel

go 1.19
