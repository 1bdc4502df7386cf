"""``dedup-proxy demo``, the main job: a realistic load through the proxy and around it
while things fail, read by the Spark job, reported in a table, a chart and JSON."""
