"""Control: complexity estimation, early exit, monitors, admission, policies (static, PID,
PPO and its training), the decode controller and quality loop, simulators, the in-process
adaptive server and its result cache."""
