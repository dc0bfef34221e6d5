"""`pdserve plan`: size a deployment before running it (the command: cli.py). Light on purpose:
Serve's controller imports pdserve.plan.profile_file through the planner's autoscaling policy."""
