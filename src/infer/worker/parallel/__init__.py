"""An engine of several processes: a TP group (rank 0 schedules and sends each step's commands to its followers),
pipeline stages, and the supervisor that starts a DP rank's processes on one node. They build engines, so they sit
above the engine core, which never imports them (a pipeline's stage 0 and the command channel reach the engine as
the protocols it declares); the daemon sits above them."""
