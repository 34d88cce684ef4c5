"""The running service: vLLM on every vNUMA node behind vLLM's router, supervised, with one
endpoint that checks the deployment's API key (`vcfslm serve up|status|down`)."""
