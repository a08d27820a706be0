// dp-run --diagnose DIR: the flight recorder's dumps read back (see
// dp_run_diagnose.cpp).
#pragma once

namespace dprun {

// argv: dp-run --diagnose DIR. Prints the diagnosis; 0 when it read a dump,
// 1 when DIR holds none, 2 for a usage error.
int diagnose_main(int argc, char** argv);

}  // namespace dprun
