// dp-perf ddp: the DDP reducer's cost in a training step, beside the same
// model trained without it (run it under dp-run).
#pragma once

// argv holds the options after "ddp" (argv[0] is "ddp"). Returns the exit code.
int dp_perf_ddp_main(int argc, char** argv);
