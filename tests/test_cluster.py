"""cluster/: the cluster-launcher YAML passes Ray's own schema; the RayJob has what KubeRay requires."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from ray_resume.config import load_config

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
REPO = CLUSTER.parent
SHARED = "/mnt/shared"  # the mount point both setups give every node
SAVE_PATH = f"{SHARED}/ray_resume/ckpt"


def launcher() -> dict:
    return yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())


def rayjob() -> dict:
    return yaml.safe_load((CLUSTER / "rayjob.yaml").read_text())


def test_cluster_launcher_yaml_matches_rays_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = launcher()
    jsonschema.validate(config, schema)  # raises with the offending key
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    assert config["head_node_type"] in types and len(types) >= 2
    assert any(t.get("max_workers", 0) >= 1 for name, t in types.items() if name != config["head_node_type"])


def test_cluster_launcher_yaml_passes_rays_own_validation():
    """Ray's launcher fills in provider defaults and validates again (what `ray up` does first): our
    YAML passes, and the same check refuses a broken copy of it (so it is a check, not a no-op).
    Imported, not importorskip'd: a Ray that moves this module fails here instead of skipping."""
    from ray.autoscaler._private import util

    prepared = util.prepare_config(launcher())
    assert util.validate_config(prepared) is None
    assert prepared["available_node_types"].keys() == launcher()["available_node_types"].keys()
    with pytest.raises(jsonschema.ValidationError, match="'many' is not of type 'integer'"):
        util.validate_config({**prepared, "max_workers": "many"})


def test_cluster_launcher_mounts_shared_storage_and_installs_the_package():
    """Every node mounts the NFS share at SHARED and installs the very checkout the launcher syncs."""
    config = launcher()
    commands = [shlex.split(c.split("#")[0]) for c in config["setup_commands"]]
    parts = [cmd[cmd.index("mount") :] for cmd in commands if "mount" in cmd and "-t" in cmd]
    assert len(parts) == 1 and parts[0][parts[0].index("-t") + 1] == "nfs4" and parts[0][-1] == SHARED
    installs = [cmd[cmd.index("-e") + 1] for cmd in commands if "install" in cmd and "-e" in cmd]
    assert len(installs) == 1 and config["file_mounts"][installs[0]] == "."  # the repository itself
    starts = [s for s in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in s]
    assert len(starts) == 2  # the head's and the workers'
    for start in starts:
        assert "RAY_AUTH_MODE=token" in shlex.split(start.split(";")[-1])  # token auth on every node
    # The token every node uses is the one `ray job submit` sends from here.
    assert config["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"
    # The submit command in the header comments uses the same shared save_path.
    text = (CLUSTER / "ray-cluster.yaml").read_text()
    assert f"checkpoint.save_path={SAVE_PATH}" in submit_entrypoint(text)


def test_rayjob_has_what_kuberay_requires():
    job = rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])  # a DNS-1123 name
    spec = job["spec"]
    assert "ray_resume.run" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert head["containers"][0]["image"]
    assert cluster["workerGroupSpecs"]
    pods = [head]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["replicas"], int) and group["replicas"] >= 1
        assert group.get("minReplicas", 0) <= group["replicas"] <= group.get("maxReplicas", group["replicas"])
        worker = group["template"]["spec"]
        assert worker["containers"][0]["image"]
        pods.append(worker)
    # Every Ray pod mounts the same shared volume at the same path.
    claims = set()
    for pod in pods:
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        [name] = [n for n, path in mounts.items() if path == SHARED]
        claims.add(volumes[name]["persistentVolumeClaim"]["claimName"])
    assert len(claims) == 1


def submit_entrypoint(text: str) -> str:
    """The command after `--` of the `ray job submit` example in the YAML's header comments."""
    lines = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    first = next(i for i, line in enumerate(lines) if "ray job submit" in line)
    command = []
    for line in lines[first:]:
        command.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return " ".join(command).split(" -- ", 1)[1]


def test_both_setups_run_a_valid_config_on_the_shared_save_path():
    """The entrypoints parse, name a config that exists, and save/load on the shared mount."""
    launcher_cmd = submit_entrypoint((CLUSTER / "ray-cluster.yaml").read_text())
    # The launcher's job runs in an upload of the repository; the RayJob's image has it at /app.
    for command, to_repo in (
        (launcher_cmd, lambda p: REPO / p),
        (rayjob()["spec"]["entrypoint"], lambda p: REPO / Path(p).relative_to("/app")),
    ):
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "ray_resume.run"], argv
        local = to_repo(argv[3])
        assert local.is_file(), argv[3]
        overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        cfg = load_config(local, overrides)  # validates every key, type and combination
        assert cfg.checkpoint.save_path == SAVE_PATH and cfg.checkpoint.load_path == SAVE_PATH
        assert cfg.data.path.startswith(f"{SHARED}/")
        assert "--fault" not in argv  # no injected failure on a real cluster
