"""The test S3 endpoint (moto's server on 127.0.0.1): see image_edit_data/bench/s3_server.py."""

from image_edit_data.bench.s3_server import make_bucket, moto_server

__all__ = ["make_bucket", "moto_server"]
