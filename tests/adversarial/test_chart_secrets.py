"""The Helm chart's secrets, rendered by the real Helm engine (``helm_python``): every render of the
same values is the same (``helm template`` twice, a GitOps sync: no token made up at render time),
and each pod mounts exactly the secret files it reads (a store never holds the peer token, a
worker never the servers' private key, no pod the Kubernetes API token). Prometheus scrapes with a
metrics token of its own, never the clients' token; the example job owns its job (a job token) and
the parameter servers take an operator token; a changed token restarts the servers that read it."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (the dev extra has it)")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tensorwire"
TOKENS = {"token": "client-token-0123456789abcdef", "peerToken": "peer-token-0123456789abcdef"}
OPTIONAL = {"metricsToken": "metrics-token-0123456789abcdef", "jobToken": "job-token-0123456789abcdef",
            "operatorToken": "operator-token-0123456789abcdef"}  # fmt: skip
OPTIONAL_KEYS = ["metrics-token", "job-token", "operator-token"]
MONITOR = {"metrics": {"serviceMonitor": {"enabled": True}}}
TLS = {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}
EVERYTHING = {"store": {"enabled": True}, "example": {"enabled": True}, "tls": TLS}
VALUE_SETS = {
    "tokens": {"auth": TOKENS},
    "everything": {"auth": TOKENS, **EVERYTHING},
    "existing-secret": {"auth": {"existingSecret": "tw-tokens"}, **EVERYTHING},
    "no-replicas": {"auth": {"token": TOKENS["token"]}, "ps": {"replicas": 0}, **EVERYTHING},
    "no-auth": {"auth": {"enabled": False}, "ps": {"replicas": 0}, **EVERYTHING},
    "optional-tokens": {"auth": {**TOKENS, **OPTIONAL}, **EVERYTHING, **MONITOR},
    "existing-secret-optional": {"auth": {"existingSecret": "tw-tokens", "optionalKeys": OPTIONAL_KEYS},
                                 **EVERYTHING, **MONITOR},
}  # fmt: skip
FLAGS = ("--token-file", "--peer-token-file", "--tls-cert", "--tls-key", "--tls-ca", "--peer-tls-ca",
         "--metrics-token-file", "--operator-token-file")  # fmt: skip
SECRET_DIR = "/etc/tensorwire/"
CERT_MANAGER_KEYS = {"tls.crt", "tls.key", "ca.crt"}


@pytest.fixture(scope="module")
def helm() -> Any:
    try:
        import helm_python

        helm_python.helm_sdk_version()
    except (ImportError, OSError) as exc:
        pytest.skip(f"helm_python (pip helm-python-sdk) cannot load here: {exc}")
    return helm_python


def render(helm: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="tw", namespace="ml", is_install=True)
    docs = [
        doc
        for path, text in sorted(files.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
    ]
    return [doc for doc in docs if doc]


def pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("StatefulSet", "DaemonSet", "Job")]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_render_of_the_same_values_is_the_same(helm: Any, name: str) -> None:
    """A GitOps tool renders at every sync: a Secret that changed each time would hand the servers
    (which read their token at start) and new workers different tokens."""
    assert render(helm, VALUE_SETS[name]) == render(helm, VALUE_SETS[name])


def test_no_token_is_made_up_at_render_time(helm: Any) -> None:
    """The defaults with auth on and no token source: refused, saying how to give one (before, a
    random token was made at each render: ``lookup`` finds nothing without a cluster)."""
    for values in ({}, {"ps": {"replicas": 0}}, {"auth": {"token": TOKENS["token"]}}):
        with pytest.raises(helm.HelmError, match=r"auth\.existingSecret"):
            render(helm, values)
    with pytest.raises(helm.HelmError, match="the same"):
        render(helm, {"auth": {"token": TOKENS["token"], "peerToken": TOKENS["token"]}})
    with pytest.raises(helm.HelmError, match="16,"):  # values.schema.json: too short to be a secret
        render(helm, {"auth": {"token": "short", "peerToken": TOKENS["peerToken"]}})
    docs = render(helm, {"auth": {"existingSecret": "tw-tokens"}})
    assert not [d for d in docs if d["kind"] == "Secret"]  # the release names it, does not make it


def secret_keys(docs: list[dict[str, Any]]) -> dict[str, set[str] | None]:
    """The keys of each Secret the release makes; None for one it only names (its keys unknown)."""
    keys: dict[str, set[str] | None] = {
        d["metadata"]["name"]: set(d["data"]) for d in docs if d["kind"] == "Secret"
    }
    keys |= {d["spec"]["secretName"]: CERT_MANAGER_KEYS for d in docs if d["kind"] == "Certificate"}
    return keys


def mounted_files(docs: list[dict[str, Any]], workload: dict[str, Any]) -> set[str]:
    """Every secret file the pod's container can read: each mounted Secret's projected keys (all its
    keys when nothing is projected; ``*`` when those are not known)."""
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    known = secret_keys(docs)
    files: set[str] = set()
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"])
        if secret is None:
            continue
        keys = [item["path"] for item in secret.get("items", [])] or sorted(
            known.get(secret["secretName"]) or "*"
        )
        files |= {posixpath.join(mount["mountPath"], key) for key in keys}
    return files


def read_files(workload: dict[str, Any]) -> set[str]:
    """Every secret file the pod's container reads: named by a flag of its command line or its
    probe's, or by an environment variable."""
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    argvs = [container.get("command", []) + container.get("args", [])]
    argvs += [container[p]["exec"]["command"] for p in ("readinessProbe", "livenessProbe") if p in container]
    files = {argv[i + 1] for argv in argvs for i, arg in enumerate(argv[:-1]) if arg in FLAGS}
    files |= {e["value"] for e in container.get("env", []) if str(e.get("value", "")).startswith(SECRET_DIR)}
    return files


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_each_pod_mounts_exactly_the_secret_files_it_reads(helm: Any, name: str) -> None:
    """Before, every server pod mounted the whole auth Secret (a store, which never replicates, held
    the peer token) and the example job mounted the whole TLS Secret (the servers' private key)."""
    docs = render(helm, VALUE_SETS[name])
    for workload in pods(docs):
        what = f"{name}: {workload['kind']} {workload['metadata']['name']}"
        assert mounted_files(docs, workload) == read_files(workload), what
        for ref in workload["spec"]["template"]["spec"]["containers"][0].get("env", []):
            key = ref.get("valueFrom", {}).get("secretKeyRef")
            if key:  # a token in the environment names a key of a Secret the release makes or names
                keys = secret_keys(docs).get(key["name"])
                assert keys is None or key["key"] in keys, what


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_no_pod_gets_a_kubernetes_api_token(helm: Any, name: str) -> None:
    """No tensorwire process calls the Kubernetes API: the service account token is not mounted."""
    for workload in pods(render(helm, VALUE_SETS[name])):
        assert workload["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_a_store_on_the_nodes_network_needs_a_token(helm: Any) -> None:
    """With hostNetwork the store listens on every interface of the node, beyond the cluster."""
    with pytest.raises(helm.HelmError, match=r"hostNetwork needs auth\.enabled"):
        render(helm, {"auth": {"enabled": False}, "ps": {"replicas": 0},
                      "store": {"enabled": True, "hostNetwork": True}})  # fmt: skip
    assert render(helm, {"auth": TOKENS, "store": {"enabled": True, "hostNetwork": True}})


def workload(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def args(pod: dict[str, Any]) -> list[str]:
    (container,) = pod["spec"]["template"]["spec"]["containers"]
    return [*container.get("command", []), *container.get("args", [])]


def flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == name]


def argv_of(pod: dict[str, Any]) -> str:
    return " ".join(args(pod))


@pytest.mark.parametrize("name", ["optional-tokens", "existing-secret-optional"])
def test_prometheus_bears_the_metrics_token_never_the_clients(helm: Any, name: str) -> None:
    """Before, the ServiceMonitor sent no bearer (so Grafana showed pseudonyms), and the only way to
    see job ids was to give Prometheus the clients' token, which then crossed the network in the
    clear at every scrape."""
    docs = render(helm, VALUE_SETS[name])
    (monitor,) = workload(docs, "ServiceMonitor")
    secret = "tw-tokens" if "existing" in name else "tw-tensorwire-auth"
    for endpoint in monitor["spec"]["endpoints"]:
        bearer = {"type": "Bearer", "credentials": {"name": secret, "key": "metrics-token"}}
        assert endpoint["authorization"] == bearer
    for server in workload(docs, "StatefulSet") + workload(docs, "DaemonSet"):
        assert flag(args(server), "--metrics-token-file") == ["/etc/tensorwire/auth/metrics-token"]
    (made,) = workload(docs, "Secret") or [None]
    if made is not None:
        assert len(set(made["data"].values())) == len(made["data"])  # each key another secret


def test_without_a_metrics_token_the_monitor_sends_nothing(helm: Any) -> None:
    docs = render(helm, {"auth": TOKENS, **MONITOR})
    (monitor,) = workload(docs, "ServiceMonitor")
    assert all("authorization" not in e for e in monitor["spec"]["endpoints"])
    assert not any("--metrics-token-file" in argv_of(p) for p in pods(docs))


def test_the_example_job_owns_its_job_and_the_servers_take_an_operator_token(helm: Any) -> None:
    """Before, the example job started an open job (no TENSORWIRE_JOB_TOKEN: any holder of the
    clients' token could end it) and the chart had no --operator-token-file."""
    docs = render(helm, VALUE_SETS["optional-tokens"])
    (job,) = workload(docs, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == "TENSORWIRE_JOB_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "tw-tensorwire-auth", "key": "job-token"}
    assert "operator-token" not in argv_of(job)
    for ps in workload(docs, "StatefulSet"):
        assert flag(args(ps), "--operator-token-file") == ["/etc/tensorwire/auth/operator-token"]
        assert "job-token" not in str(ps)  # a server never holds a job's token
    for store in workload(docs, "DaemonSet"):  # a store holds no job: no operator token either
        assert "operator-token" not in str(store) and "job-token" not in str(store)


def test_optional_tokens_are_never_made_up_nor_shared(helm: Any) -> None:
    with pytest.raises(helm.HelmError, match=r"no metrics-token.*auth\.existingSecret"):
        render(helm, {"auth": {**TOKENS, "optionalKeys": ["metrics-token"]}})
    for key in OPTIONAL:
        with pytest.raises(helm.HelmError, match="the same"):
            render(helm, {"auth": {**TOKENS, key: TOKENS["token"]}})
    with pytest.raises(helm.HelmError, match="the same"):
        render(helm, {"auth": {**TOKENS, **OPTIONAL, "metricsToken": OPTIONAL["jobToken"]}})


def checksums(docs: list[dict[str, Any]]) -> dict[str, str | None]:
    """Each server workload's ``checksum/auth`` pod annotation (None: none)."""
    servers = workload(docs, "StatefulSet") + workload(docs, "DaemonSet")
    found = {d["metadata"]["name"]: d["spec"]["template"]["metadata"].get("annotations") for d in servers}
    return {name: (annotations or {}).get("checksum/auth") for name, annotations in found.items()}


def test_a_changed_token_restarts_the_servers_that_read_it(helm: Any) -> None:
    """Servers read their token files at start; before, a changed token changed only the Secret, so
    a GitOps sync left the servers on the old token and new workers were refused."""
    values = {"auth": {**TOKENS, **OPTIONAL}, "store": {"enabled": True}}
    before = checksums(render(helm, values))
    assert all(before.values()) and before == checksums(render(helm, values))  # stable
    token = {**values, "auth": {**values["auth"], "token": "rotated-token-0123456789"}}
    rotated = checksums(render(helm, token))
    assert all(rotated[name] != digest for name, digest in before.items())  # every server reads it
    operator = {**values, "auth": {**values["auth"], "operatorToken": "rotated-operator-0123456789"}}
    changed = {n for n, d in checksums(render(helm, operator)).items() if d != before[n]}
    assert changed == {n for n in before if "-ps-" in n}  # the parameter servers only, not the store
    job = {**values, "auth": {**values["auth"], "jobToken": "rotated-job-token-0123456789"}}
    assert checksums(render(helm, job)) == before  # no server reads the job's token
    unknown = checksums(render(helm, {"auth": {"existingSecret": "tw-tokens"}, "store": {"enabled": True}}))
    assert set(unknown.values()) == {None}  # an existing Secret no cluster shows: restart by hand (README)
    assert not any(TOKENS["token"] in str(d) for d in before.values())
