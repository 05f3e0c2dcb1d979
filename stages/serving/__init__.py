"""The shared serving engine of issue 17 (no paper code): latency profile, simulator, real server."""
