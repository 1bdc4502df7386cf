"""The lab's standalone Spark cluster, the parts that start nothing: ports, shape, home."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.spark_cluster import ClusterPorts, ClusterShape, SparkCluster, cluster_home

pytestmark = pytest.mark.unit


def test_ports_stay_below_the_ephemeral_range_and_apart() -> None:
    ports = ClusterPorts(31700)
    used = [ports.master, ports.master_ui]
    used += [p for i in range(9) for p in (ports.worker(i), ports.worker_ui(i))]
    assert len(set(used)) == len(used)
    assert max(used) < 32768
    with pytest.raises(ValueError, match="outside"):
        ClusterPorts(32760)
    assert ClusterPorts.from_env({"DEDUP_SPARK_CLUSTER_PORT": "31000"}).worker(1) == 31011
    assert ClusterPorts.from_env({}) == ClusterPorts()


def test_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="workers"):
        ClusterShape(workers=0)
    with pytest.raises(ValueError, match="cores"):
        ClusterShape(cores=0)


def test_home_follows_xdg_unless_named(tmp_path: Path) -> None:
    assert cluster_home({"DEDUP_SPARK_CLUSTER_HOME": str(tmp_path)}) == tmp_path.resolve()
    assert cluster_home({"XDG_STATE_HOME": str(tmp_path)}) == (
        tmp_path / "kafka-dedup-proxy" / "spark-cluster"
    )
    # A relative XDG value is invalid and ignored.
    assert cluster_home({"XDG_STATE_HOME": "rel"}).parts[-3:] == (
        "state",
        "kafka-dedup-proxy",
        "spark-cluster",
    )


def test_a_cluster_never_created_has_no_status_but_its_home(tmp_path: Path) -> None:
    assert SparkCluster(tmp_path, ClusterPorts(31700)).status() == {
        "home": str(tmp_path),
        "created": False,
    }
    assert SparkCluster(tmp_path, ClusterPorts(31700)).master_url == "spark://127.0.0.1:31700"
