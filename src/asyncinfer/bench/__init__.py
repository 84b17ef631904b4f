"""`asyncinfer bench`: ``offline`` in throughput.py; ``serve`` in serve.py, which runs plan,
client, scrape, service and report. The peer comparisons are the repository's benchmarks/."""
