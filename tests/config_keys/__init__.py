"""Every documented config key changes what the code does: the probes, their harness and the tests (test_keys)."""
