"""A real S3 API server for tests: moto's standalone server on 127.0.0.1, one bucket made,
stopped by the process group this helper started."""

from __future__ import annotations

import sys
import urllib.request
from contextlib import contextmanager

from servers import free_port, served

# moto accepts any credentials; they ride in the URI (s3://KEY:SECRET@bucket/...), so the
# Ray workers (whose environment was fixed when the shared Ray started) can use them too
KEY = SECRET = "testing"


@contextmanager
def s3_server(root, bucket: str = "runs"):
    """Yield ``(endpoint, bucket)`` of a server holding an empty ``bucket``."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    with served([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], root / "s3.log",
                f"http://{endpoint}/moto-api/"):
        urllib.request.urlopen(urllib.request.Request(f"http://{endpoint}/{bucket}", method="PUT"), timeout=10).close()
        yield endpoint, bucket
