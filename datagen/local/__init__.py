"""Local stand-ins of real parts for laptops, the demo and tests: the S3 server and a model directory."""
