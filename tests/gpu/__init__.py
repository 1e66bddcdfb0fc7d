"""GPU tests: a package, so that their module names do not clash with tests/cpu (test_training, test_buckets)."""
