from collections.abc import Iterator

import pytest

from tests.cluster.harness import Cluster, create_cluster, destroy_cluster, services_available
from tests.hub.conftest import CountingProxy

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server) -> Iterator[Cluster]:
    """PostgreSQL + Redis + S3 (behind a request-counting forwarder); two node agents (node-a,
    node-b) and two web processes (a, b), each a separate OS process."""
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    s3_server.reset()
    counter = CountingProxy.start(s3_server.host, s3_server.port)
    c = create_cluster(tmp_path_factory.mktemp("cluster"), s3_endpoint=counter.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key,
                       extra_env={"XGEN_COLD_START_TIMEOUT_S": "120"})
    c.s3_counter = counter
    try:
        c.start_agent("node-a")
        c.start_agent("node-b")
        c.start_web("a")
        c.start_web("b")
        c.wait_nodes_online({"node-a", "node-b"}, web="a")
        yield c
    finally:
        destroy_cluster(c)
        counter.stop()
