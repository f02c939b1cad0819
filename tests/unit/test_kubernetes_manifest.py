"""docs/kubernetes.md's manifest fits together: parsed (PyYAML) and checked field by field, the agent's and
the master's command lines by stalwart's own parsers. No API server here: not a server-side validation."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from stalwart.commands import master as master_command
from stalwart.launch.preempt import EXIT_PREEMPTED, parse_signals
from stalwart.launch.run import build_parser

yaml = pytest.importorskip("yaml", reason="PyYAML (the test extra) parses the manifest")
DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    [block] = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    docs = [d for d in yaml.safe_load_all(block) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_objects_and_api_versions(objects):
    assert {k: objects[k]["apiVersion"] for k in objects} == {
        ("Service", "stalwart-master"): "v1",
        ("Service", "stalwart-nodes"): "v1",
        ("Deployment", "stalwart-master"): "apps/v1",
        ("Job", "stalwart-train"): "batch/v1",
    }


def test_services_select_their_pods(objects):
    master = objects["Deployment", "stalwart-master"]["spec"]
    assert master["selector"]["matchLabels"].items() <= master["template"]["metadata"]["labels"].items()
    assert objects["Service", "stalwart-master"]["spec"]["selector"] == master["selector"]["matchLabels"]
    job = objects["Job", "stalwart-train"]["spec"]
    nodes = objects["Service", "stalwart-nodes"]["spec"]
    assert nodes["clusterIP"] == "None", "headless"
    assert nodes["selector"].items() <= job["template"]["metadata"]["labels"].items()
    assert job["template"]["spec"]["subdomain"] == "stalwart-nodes"


def master_args(objects) -> argparse.Namespace:
    [container] = objects["Deployment", "stalwart-master"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["stalwart", "master"]
    parser = argparse.ArgumentParser()
    master_command.register(parser.add_subparsers())
    return parser.parse_args(container["command"][1:])


def agent(objects) -> tuple[dict, argparse.Namespace]:
    [container] = objects["Job", "stalwart-train"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["stalwart", "run"]
    return container, build_parser().parse_args(container["command"][2:])


def test_agents_reach_the_master_and_its_rendezvous_store(objects):
    m = master_args(objects)
    ports = {p["name"]: p["port"] for p in objects["Service", "stalwart-master"]["spec"]["ports"]}
    assert (m.host, m.port, m.rdzv_port) == ("0.0.0.0", ports["api"], ports["rdzv"])
    _, args = agent(objects)
    assert args.master == f"http://stalwart-master:{ports['api']}"
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", f"stalwart-master:{ports['rdzv']}")
    assert args.module and args.training_script == "stalwart" and args.training_script_args[0] == "train"


def test_node_count_leaves_room_for_spares(objects):
    job = objects["Job", "stalwart-train"]["spec"]
    _, args = agent(objects)
    low, high = (int(n) for n in args.nnodes.split(":"))
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] > high >= low


def test_preemption_is_a_persisted_requeue_not_a_failure(objects):
    pod = objects["Job", "stalwart-train"]["spec"]["template"]["spec"]
    container, args = agent(objects)
    assert {"SIGTERM", "SIGUSR1"} <= {s.name for s in parse_signals(args.preempt_signals)}
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 60
    assert "kill -USR1 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    rules = objects["Job", "stalwart-train"]["spec"]["podFailurePolicy"]["rules"]
    ignored = [r["onExitCodes"] for r in rules if r["action"] == "Ignore" and "onExitCodes" in r]
    assert ignored == [{"containerName": container["name"], "operator": "In", "values": [EXIT_PREEMPTED]}]
    assert any(c["type"] == "DisruptionTarget" for r in rules for c in r.get("onPodConditions", []))


def test_shared_memory_and_checkpoints_are_mounted(objects):
    pod = objects["Job", "stalwart-train"]["spec"]["template"]["spec"]
    container, args = agent(objects)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    ckpt = next(a.split("=", 1)[1] for a in args.training_script_args if a.startswith("--checkpoint.dir="))
    assert any(ckpt.startswith(path + "/") and "persistentVolumeClaim" in volumes[n] for path, n in mounts.items())
    env = {e["name"]: e for e in container["env"]}
    assert env["STALWART_JOB_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "stalwart-token"
