"""The Helm chart in deploy/helm/tensorwire, checked offline (no cluster): rendered by the real Helm
engine (``helm_python``, the Helm v4 SDK as a C library) for a few value sets, linted, and every
manifest validated against the Kubernetes schemas (``kubernetes_validate``, strict: no unknown
field). Then what matters is asserted: each slot's replicas are kept off one node by a required
anti-affinity on exactly that slot's pods; ports, probes and Secrets are wired to each other;
TENSORWIRE_SERVERS names the pods' DNS names, primary first; and the entrypoint gives each ordinal
its role (the script is run, with a stand-in ``tensorwire`` that prints its arguments).
"""

from __future__ import annotations

import base64
import os
import posixpath
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (the dev extra has it)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (the dev extra has it)"
)

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tensorwire"
RELEASE, NAMESPACE, DOMAIN = "tw", "ml", "cluster.local"
# Every manifest is checked against the oldest schemas the dev extra's kubernetes-validate (>=1.30)
# ships and against the newest the installed one has.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
SLOT_LABEL = "tensorwire.io/slot"
SECRET_FLAGS = ("--token-file", "--peer-token-file", "--tls-cert", "--tls-key", "--tls-ca", "--peer-tls-ca",
                "--metrics-token-file", "--operator-token-file")  # fmt: skip
CERT_MANAGER_KEYS = {"tls.crt", "tls.key", "ca.crt"}  # what a cert-manager Certificate's Secret holds

ETCD = ["etcd-0.etcd.db.svc:2379", "etcd-1.etcd.db.svc:2379", "etcd-2.etcd.db.svc:2379"]

# The chart makes no token of its own (one made at render time would change at every render): a
# release names a Secret (auth.existingSecret) or gives the tokens.
TOKENS = {"token": "client-token-0123456789abcdef", "peerToken": "peer-token-0123456789abcdef"}
OPTIONAL = {"metricsToken": "metrics-token-0123456789abcdef", "jobToken": "job-token-0123456789abcdef",
            "operatorToken": "operator-token-0123456789abcdef"}  # fmt: skip
FULL = {
    "auth": {**TOKENS, **OPTIONAL},
    "ps": {"slots": 3, "replicas": 2, "antiAffinity": {"topologyKey": "topology.kubernetes.io/zone"},
           "persistence": {"enabled": True}},
    "tls": {"enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "store": {"enabled": True, "hostNetwork": True, "hostIPC": True, "shm": {"enabled": True},
              "dataDir": {"type": "hostPath"}},
    "topology": {"rackFromZone": True},
    "example": {"enabled": True},
}  # fmt: skip
VALUE_SETS = {
    "defaults": {"auth": TOKENS},  # the defaults, and the tokens every release brings
    "full": FULL,
    "no-replicas": {"auth": {"token": TOKENS["token"]},
                    "ps": {"slots": 1, "replicas": 0, "antiAffinity": {"hostname": "preferred"}}},
    "existing-secret": {"auth": {"existingSecret": "tw-tokens",
                                 "optionalKeys": ["metrics-token", "operator-token"]},
                        "store": {"enabled": True}},
    "no-auth": {"auth": {"enabled": False}, "ps": {"replicas": 0}, "store": {"enabled": True}},
    # etcd elects each slot's primary (issue 37); the credentials' variants are tested further down
    "coordinator": {"auth": TOKENS, "ps": {"replicas": 2}, "coordinator": {"endpoints": ETCD}},
}  # fmt: skip


@pytest.fixture(scope="module")
def helm() -> Any:
    """The Helm SDK, or a skip that says why (no wheel of it, or its library cannot load here)."""
    try:
        import helm_python

        helm_python.helm_sdk_version()  # loads the native library
    except (ImportError, OSError) as exc:
        pytest.skip(f"helm_python (pip helm-python-sdk) cannot load here: {exc}")
    return helm_python


def render(helm: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every manifest the chart renders with ``values`` (NOTES.txt aside), parsed."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [
        doc
        for path, text in sorted(files.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
    ]
    return [doc for doc in docs if doc]


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def case(request: pytest.FixtureRequest, helm: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = VALUE_SETS[request.param]
    return values, render(helm, values)


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]


# -- the chart as a whole ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_finds_no_errors(helm: Any, name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True)
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report  # no warning either


def test_every_manifest_validates_against_the_kubernetes_schemas(case: Any) -> None:
    _, docs = case
    for doc in docs:
        if doc["apiVersion"].split("/")[0] in CRD_CHECKS:
            CRD_CHECKS[doc["apiVersion"].split("/")[0]](doc)
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def check_service_monitor(doc: dict[str, Any]) -> None:
    """kubernetes-validate has no schema for CRDs; these are the fields the Prometheus Operator's
    ServiceMonitor CRD (monitoring.coreos.com/v1) requires, and the ones this chart relies on."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "ServiceMonitor"
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"], "an empty selector would scrape every Service"
    assert spec["endpoints"] and all(isinstance(e["port"], str) for e in spec["endpoints"])
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}


def check_certificate(doc: dict[str, Any]) -> None:
    """kubernetes-validate has no schema for CRDs; these are the fields cert-manager's Certificate
    CRD (cert-manager.io/v1) requires (secretName, issuerRef.name) and the types it declares."""
    assert doc["apiVersion"] == "cert-manager.io/v1" and doc["kind"] == "Certificate"
    spec = doc["spec"]
    assert isinstance(spec["secretName"], str) and spec["issuerRef"]["name"]
    assert spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
    assert all(isinstance(n, str) for n in spec["dnsNames"] + spec.get("ipAddresses", []))
    assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
    assert set(spec) <= {"secretName", "issuerRef", "dnsNames", "ipAddresses", "duration", "renewBefore",
                         "privateKey", "usages", "commonName", "secretTemplate"}  # fmt: skip


CRD_CHECKS = {"monitoring.coreos.com": check_service_monitor, "cert-manager.io": check_certificate}


def test_values_that_cannot_work_are_refused(helm: Any) -> None:
    for values, says in [
        ({"tls": {"enabled": True}}, "tls.existingSecret"),
        ({"store": {"enabled": True, "shm": {"enabled": True}}}, "hostNetwork"),
        ({"tls": {"enabled": True, "certManager": {"enabled": True}}}, "issuerRef"),
        ({"ps": {"antiAffinity": {"hostname": "maybe"}}}, "required"),  # values.schema.json
        ({"ps": {"slot": 3}}, "additional properties 'slot'"),  # a typo is not silently ignored
    ]:
        with pytest.raises(helm.HelmError, match=says):
            render(helm, {"auth": TOKENS, **values})


# -- the parameter-server slots ---------------------------------------------------------------------
def slots(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(of_kind(docs, "StatefulSet"), key=lambda s: int(s["metadata"]["labels"][SLOT_LABEL]))


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def pod_urls(docs: list[dict[str, Any]], sts: dict[str, Any], scheme: str, port: int) -> list[str]:
    """The URL of each pod of ``sts``, by the DNS name its headless Service gives it."""
    service = one(docs, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc.{DOMAIN}"
    name = sts["metadata"]["name"]
    return [f"{scheme}://{name}-{i}.{host}:{port}" for i in range(sts["spec"]["replicas"])]


def test_one_statefulset_per_slot_with_a_primary_and_its_standbys(case: Any) -> None:
    values, docs = case
    ps = {"slots": 2, "replicas": 1, **values.get("ps", {})}
    found = slots(docs)
    assert [s["metadata"]["labels"][SLOT_LABEL] for s in found] == [str(n) for n in range(ps["slots"])]
    for sts in found:
        assert sts["spec"]["replicas"] == ps["replicas"] + 1
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_a_slots_replicas_repel_each_other_by_node(case: Any) -> None:
    values, docs = case
    anti = values.get("ps", {}).get("antiAffinity", {})
    for sts in slots(docs):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        rules = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        required = rules.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        preferred = [
            t["podAffinityTerm"] for t in rules.get("preferredDuringSchedulingIgnoredDuringExecution", [])
        ]
        by_node = required if anti.get("hostname", "required") == "required" else preferred
        (term,) = [t for t in by_node if t["topologyKey"] == "kubernetes.io/hostname"]
        selected = term["labelSelector"]["matchLabels"]
        assert selected.items() <= labels.items()  # it selects this slot's own pods...
        assert selected[SLOT_LABEL] == labels[SLOT_LABEL]  # ...and only them (not another slot's)
        assert selected["app.kubernetes.io/instance"] == RELEASE
        zone = [t for t in preferred if t["topologyKey"] == "topology.kubernetes.io/zone"]
        assert len(zone) == (1 if anti.get("topologyKey") else 0)
        assert all(t["labelSelector"] == term["labelSelector"] for t in zone)


def test_a_disruption_budget_per_slot(case: Any) -> None:
    _, docs = case
    budgets = {
        b["spec"]["selector"]["matchLabels"][SLOT_LABEL]: b for b in of_kind(docs, "PodDisruptionBudget")
    }
    for sts in slots(docs):
        budget = budgets.pop(sts["metadata"]["labels"][SLOT_LABEL])
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert not budgets


def test_tensorwire_servers_lists_the_pods_dns_names_primary_first(case: Any) -> None:
    values, docs = case
    scheme = "tls" if values.get("tls", {}).get("enabled") else "tcp"
    (config,) = of_kind(docs, "ConfigMap")
    expected = ",".join("|".join(pod_urls(docs, sts, scheme, 7070)) for sts in slots(docs))
    assert config["data"]["TENSORWIRE_SERVERS"] == expected
    if values.get("ps", {}).get("replicas") == 0:
        assert "|" not in expected


def run_entrypoint(
    workload: dict[str, Any], pod: str, stub_dir: Path, etcd_secret: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The container's command and args as the kubelet runs them, in pod ``pod``, with the stand-in
    ``tensorwire`` (it prints one argument a line) first on PATH; ``etcd_secret``: a directory that
    stands in for the mounted coordinator.existingSecret."""
    c = container(workload)
    env = {"PATH": f"{stub_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "TENSORWIRE_POD_NAME": pod}
    command = c["command"]
    if etcd_secret is not None:
        command = [part.replace(COORDINATOR_DIR, str(etcd_secret)) for part in command]
    argv = [*command, *c["args"]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stub = tmp_path_factory.mktemp("bin") / "tensorwire"
    stub.write_text('#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done\n')
    stub.chmod(0o755)
    return stub.parent


def role_flags(urls: list[str], ordinal: int) -> list[str]:
    """What ``tensorwire ps launch`` gives replica ``ordinal`` of a slot (``replica_flags``, the
    source of truth), less the peer token: the chart passes that among the flags all replicas share."""
    from tensorwire.ps.launch import replica_flags

    flags = replica_flags(urls, ordinal, Path("PEER"))
    assert flags[:2] == ["--peer-token-file", "PEER"]
    return flags[2:]


def test_each_ordinal_gets_its_role_and_every_other_replica_as_backup(case: Any, stub_dir: Path) -> None:
    values, docs = case
    scheme = "tls" if values.get("tls", {}).get("enabled") else "tcp"
    for sts in slots(docs):
        urls = pod_urls(docs, sts, scheme, 7070)
        common = container(sts)["args"]
        for ordinal in range(len(urls)):
            done = run_entrypoint(sts, f"{sts['metadata']['name']}-{ordinal}", stub_dir)
            assert done.returncode == 0, done.stderr
            argv = done.stdout.splitlines()
            advertise = ["--advertise", urls[ordinal]] if "coordinator" in values else []
            assert argv == ["ps", "serve", *common, *role_flags(urls, ordinal), *advertise]
            assert bool(flag_values(argv, "--peer-token-file")) == (len(urls) > 1)
        stray = run_entrypoint(sts, f"{sts['metadata']['name']}-{len(urls)}", stub_dir)
        assert stray.returncode == 64 and "is not replica" in stray.stderr


# -- ports, probes and Secrets ----------------------------------------------------------------------
def servers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return slots(docs) + of_kind(docs, "DaemonSet")


def test_ports_agree_between_containers_services_and_probes(case: Any) -> None:
    values, docs = case
    for workload in servers(docs):
        c = container(workload)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        listen = flag_values(c["args"], "--listen")[0]
        assert listen.endswith(f":{ports['tensorwire']}")
        assert flag_values(c["args"], "--metrics-port") == [str(ports["metrics"])]
        for probe in (c["readinessProbe"], c["livenessProbe"]):
            url = probe["exec"]["command"][probe["exec"]["command"].index("probe") + 1]
            assert url == f"{listen.split('://')[0]}://localhost:{ports['tensorwire']}"
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        services = [
            s for s in of_kind(docs, "Service") if s["spec"]["selector"].items() <= pod_labels.items()
        ]
        assert services, f"no Service selects {workload['metadata']['name']}"
        for service in services:
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
    for monitor in of_kind(docs, "ServiceMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        selected = [s for s in of_kind(docs, "Service") if wanted <= s["metadata"]["labels"].items()]
        assert len(selected) == (2 if values.get("store", {}).get("enabled") else 1)
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in selected)


def test_probes_exec_tensorwire_probe(case: Any) -> None:
    _, docs = case
    for workload in servers(docs):
        for probe in (container(workload)["readinessProbe"], container(workload)["livenessProbe"]):
            command = probe["exec"]["command"]
            assert command[0] == "tensorwire" and "probe" in command
            assert float(command[command.index("--timeout") + 1]) < probe["timeoutSeconds"]


def secret_files(docs: list[dict[str, Any]], workload: dict[str, Any]) -> dict[str, tuple[str, set[str]]]:
    """Each directory a Secret is mounted at in ``workload``: (the Secret's name, the keys it
    projects there, each one the release's Secret has when the release makes it)."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    keys = {s["metadata"]["name"]: set(s["data"]) for s in of_kind(docs, "Secret")}
    keys |= {c["spec"]["secretName"]: CERT_MANAGER_KEYS for c in of_kind(docs, "Certificate")}
    mounted = {}
    for mount in container(workload)["volumeMounts"]:
        if mount["name"] in volumes:
            assert mount["readOnly"]
            secret = volumes[mount["name"]]
            projected = {item["key"] for item in secret.get("items", [])}
            assert all(item["key"] == item["path"] for item in secret.get("items", []))
            made = keys.get(secret["secretName"])  # None: a Secret the release names, not makes
            assert made is None or projected <= made, (secret, made)
            mounted[mount["mountPath"]] = (secret["secretName"], projected or made or set())
    return mounted


def test_secrets_are_mounted_and_named_by_the_flags(case: Any) -> None:
    values, docs = case
    auth = values.get("auth", {}).get("enabled", True)
    tls = values.get("tls", {}).get("enabled", False)
    for workload in servers(docs):
        c = container(workload)
        mounted = secret_files(docs, workload)
        probe = c["readinessProbe"]["exec"]["command"]
        for argv in (c["args"], probe):
            assert all(len(a) < 200 for a in argv)  # no PEM or token inline
            for flag in SECRET_FLAGS:
                for path in flag_values(argv, flag):
                    secret, keys = mounted[posixpath.dirname(path)]
                    assert posixpath.basename(path) in keys, (flag, path, secret)
        assert (
            bool(flag_values(c["args"], "--token-file")) == auth == bool(flag_values(probe, "--token-file"))
        )
        assert bool(flag_values(c["args"], "--tls-cert")) == tls == bool(flag_values(probe, "--tls-ca"))
        if workload["kind"] == "StatefulSet" and tls and workload["spec"]["replicas"] > 1:
            assert flag_values(c["args"], "--peer-tls-ca")


def test_topology_comes_from_the_downward_api(case: Any) -> None:
    values, docs = case
    for workload in servers(docs) + of_kind(docs, "Job"):
        env = {
            e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            for e in container(workload)["env"]
        }
        assert env["TENSORWIRE_HOST"] == "spec.nodeName"
        if values.get("topology", {}).get("rackFromZone"):
            assert env["TENSORWIRE_RACK"] == "metadata.labels['topology.kubernetes.io/zone']"
        else:
            assert "TENSORWIRE_RACK" not in env


# -- the per-node store and the example job -------------------------------------------------------
def test_the_store_serves_shm_to_its_node_and_keeps_data_where_asked(helm: Any) -> None:
    docs = render(helm, FULL)
    (store,) = of_kind(docs, "DaemonSet")
    pod, args = store["spec"]["template"]["spec"], container(store)["args"]
    assert pod["hostIPC"] and pod["hostNetwork"] and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "shm://127.0.0.1:7071" in flag_values(args, "--listen")
    (data,) = [v for v in pod["volumes"] if v["name"] == "data"]
    assert data["hostPath"]["path"] == "/var/lib/tensorwire"
    mount = next(m for m in container(store)["volumeMounts"] if m["name"] == "data")
    assert flag_values(args, "--data-dir") == [mount["mountPath"]]
    service = one(docs, "Service", f"{RELEASE}-tensorwire-store")
    assert service["spec"]["internalTrafficPolicy"] == "Local"  # each pod reaches its own node's store


def test_the_example_job_reads_the_servers_from_the_configmap(helm: Any) -> None:
    docs = render(helm, FULL)
    (job,) = of_kind(docs, "Job")
    c = container(job)
    (config,) = of_kind(docs, "ConfigMap")
    assert {"configMapRef": {"name": config["metadata"]["name"]}} in c["envFrom"]
    assert c["command"][0] == "torchrun"
    (token,) = [e for e in c["env"] if e["name"] == "TENSORWIRE_TOKEN"]
    assert (
        token["valueFrom"]["secretKeyRef"]["key"] in one(docs, "Secret", f"{RELEASE}-tensorwire-auth")["data"]
    )
    (ca,) = [e for e in c["env"] if e["name"] == "TENSORWIRE_TLS_CA"]  # FULL serves TLS
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    assert ca["value"] == f"{mount['mountPath']}/ca.crt"
    server_tls = next(v for v in slots(docs)[0]["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    (volume,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == server_tls["secret"]["secretName"]


def iter_values(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for value in node.values():
            yield from iter_values(value)
    elif isinstance(node, list):
        for value in node:
            yield from iter_values(value)
    else:
        yield node


def test_no_token_reaches_a_pod_spec(helm: Any) -> None:
    docs = render(helm, FULL)
    secrets = {v for s in of_kind(docs, "Secret") for v in s["data"].values()}
    assert secrets
    plain = {base64.b64decode(v).decode() for v in secrets}
    for doc in docs:
        if doc["kind"] != "Secret":
            assert not any(isinstance(v, str) and any(p in v for p in plain) for v in iter_values(doc))


def test_tensorwire_accepts_every_command_line_the_chart_writes(
    case: Any, stub_dir: Path, tmp_path: Path
) -> None:
    """Each server's and probe's command line, parsed by the real ``tensorwire`` commands (click
    checks every flag name, size, URL and number, and that the files exist: the mounted Secrets
    are stood in for under ``tmp_path``); nothing is started."""
    from tensorwire.cli import main

    values, docs = case
    if "coordinator" in values:
        needs_coordinator_flags()
    for workload in servers(docs):
        c = container(workload)
        if workload["kind"] == "StatefulSet":
            pod = f"{workload['metadata']['name']}-{workload['spec']['replicas'] - 1}"  # a standby, if any
            argv = run_entrypoint(workload, pod, stub_dir).stdout.splitlines()
        else:
            argv = [*c["command"][1:], *c["args"]]
        probe = c["readinessProbe"]["exec"]["command"][1:]
        for line in (argv, probe[probe.index("probe") :]):
            parse(main, [stand_in(arg, tmp_path) for arg in line])


def stand_in(arg: str, root: Path) -> str:
    """A file under /etc/tensorwire (a mounted Secret) -> one with a token in it under ``root``."""
    if not arg.startswith("/etc/tensorwire/"):
        return arg
    path = root / arg.removeprefix("/etc/tensorwire/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{path.name}-{'x' * 32}\n")
    path.chmod(0o600)
    return str(path)


def parse(group: Any, argv: list[str]) -> None:
    """Resolve ``argv``'s subcommands in ``group`` and parse the rest as that command would."""
    command = group
    while hasattr(command, "commands") and argv and argv[0] in command.commands:
        command, argv = command.commands[argv[0]], argv[1:]
    assert not hasattr(command, "commands"), f"no command for {argv}"
    command.make_context(command.name, argv)


# -- leadership from etcd (coordinator.*, issue 37) -----------------------------------------------
COORDINATOR_DIR = "/etc/tensorwire/coordinator"  # where coordinator.existingSecret is mounted
COORDINATED = {
    "auth": TOKENS,
    "ps": {"slots": 2, "replicas": 2},
    "tls": {"enabled": True, "existingSecret": "tw-tls"},
    "coordinator": {"endpoints": ETCD, "prefix": "/tensorwire/ml", "leaseTtl": 5, "tls": True,
                    "existingSecret": "tw-etcd"},
}  # fmt: skip
ETCD_USER, ETCD_PASSWORD = "tw-server", "etcd-password-0123456789abcdef"
ETCD_KEYS = {"username": f"{ETCD_USER}\n", "password": f"{ETCD_PASSWORD}\n", "ca.crt": "CA\n",
             "tls.crt": "CERT\n", "tls.key": "KEY\n"}  # fmt: skip
COORDINATOR_ARGS = ("--coordinator", "--slot", "--advertise", "--lease-ttl", "--coordinator-user",
                    "--coordinator-password-file", "--coordinator-tls-ca", "--coordinator-tls-cert",
                    "--coordinator-tls-key")  # fmt: skip


def needs_coordinator_flags() -> None:
    """Skip until ``tensorwire ps serve`` takes the coordinator's flags (issue 37, being added)."""
    from tensorwire.cli import main

    serve = main.commands["ps"].commands["serve"]
    names = {name for param in serve.params for name in getattr(param, "opts", ())}
    missing = [flag for flag in COORDINATOR_ARGS if flag not in names]
    if missing:
        pytest.skip(f"tensorwire ps serve has no {', '.join(missing)} yet (issue 37)")


def etcd_secret(root: Path, keys: Any) -> Path:
    """A stand-in for coordinator.existingSecret as a pod sees it: a directory holding ``keys``."""
    folder = root / "etcd-secret"
    folder.mkdir(parents=True)
    for key in keys:
        (folder / key).write_text(ETCD_KEYS[key])
        (folder / key).chmod(0o600)
    return folder


def coordinated(helm: Any, **coordinator: Any) -> list[dict[str, Any]]:
    values = {**COORDINATED, "coordinator": {**COORDINATED["coordinator"], **coordinator}}
    return render(helm, values)


def test_a_coordinated_release_lints_and_validates(helm: Any) -> None:
    report = helm.lint(CHART, COORDINATED, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    for doc in render(helm, COORDINATED):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_replica_of_a_slot_gets_the_coordinator_its_slot_and_the_ttl(helm: Any) -> None:
    docs = render(helm, COORDINATED)
    found = slots(docs)
    assert len(found) == 2
    for sts in found:
        args = container(sts)["args"]
        assert flag_values(args, "--coordinator") == [f"etcds://{','.join(ETCD)}/tensorwire/ml"]
        assert flag_values(args, "--slot") == [sts["metadata"]["name"]]  # one name per slot, all replicas
        assert flag_values(args, "--lease-ttl") == ["5"]
        assert not flag_values(args, "--failover-timeout")  # the lease, not silence, decides
        assert flag_values(args, "--peer-token-file")
    assert len({flag_values(container(s)["args"], "--slot")[0] for s in found}) == len(found)


def test_each_coordinated_replica_advertises_its_pod_and_reads_the_etcd_secret(
    helm: Any, stub_dir: Path, tmp_path: Path
) -> None:
    secret = etcd_secret(tmp_path, ETCD_KEYS)
    docs = render(helm, COORDINATED)
    credentials = ["--coordinator-user", ETCD_USER, "--coordinator-password-file", f"{secret}/password",
                   "--coordinator-tls-ca", f"{secret}/ca.crt", "--coordinator-tls-cert", f"{secret}/tls.crt",
                   "--coordinator-tls-key", f"{secret}/tls.key"]  # fmt: skip
    for sts in slots(docs):
        urls = pod_urls(docs, sts, "tls", 7070)
        common = container(sts)["args"]
        for ordinal, url in enumerate(urls):
            # --standby on ordinals 1..N: with a coordinator it only lets ordinal 0 campaign first
            done = run_entrypoint(sts, f"{sts['metadata']['name']}-{ordinal}", stub_dir, secret)
            assert done.returncode == 0, done.stderr
            role = [*role_flags(urls, ordinal), "--advertise", url]
            assert done.stdout.splitlines() == ["ps", "serve", *common, *role, *credentials]


def test_the_etcd_secret_is_mounted_whole_read_only_and_not_made_by_the_chart(helm: Any) -> None:
    docs = render(helm, COORDINATED)
    assert not [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == "tw-etcd"]
    for sts in slots(docs):
        pod = sts["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "coordinator"]
        assert volume["secret"]["secretName"] == "tw-etcd"
        assert "items" not in volume["secret"]  # each key is optional: the entrypoint looks which are there
        assert volume["secret"]["defaultMode"] == 0o440
        (mount,) = [m for m in container(sts)["volumeMounts"] if m["name"] == "coordinator"]
        assert mount == {"name": "coordinator", "mountPath": COORDINATOR_DIR, "readOnly": True}
    for workload in of_kind(docs, "DaemonSet") + of_kind(docs, "Job"):  # only the parameter servers
        assert "coordinator" not in {v["name"] for v in workload["spec"]["template"]["spec"]["volumes"]}


def test_no_etcd_password_reaches_a_command_line_or_the_environment(
    helm: Any, stub_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(helm.HelmError, match="additional properties 'password'"):
        coordinated(helm, password=ETCD_PASSWORD)  # there is no value to put one in
    secret = etcd_secret(tmp_path, ETCD_KEYS)
    docs = render(helm, COORDINATED)
    for sts in slots(docs):
        c = container(sts)
        assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
        assert "envFrom" not in c
        assert not [a for a in c["args"] if a.startswith("--coordinator-password") or "password" in a]
        done = run_entrypoint(sts, f"{sts['metadata']['name']}-0", stub_dir, secret)
        assert ETCD_PASSWORD not in done.stdout and ETCD_PASSWORD not in done.stderr
        assert flag_values(done.stdout.splitlines(), "--coordinator-password-file") == [f"{secret}/password"]


def test_the_etcd_secret_keys_are_optional_and_checked_when_the_pod_starts(
    helm: Any, stub_dir: Path, tmp_path: Path
) -> None:
    """Which keys the Secret holds is known only in the pod: the entrypoint passes what is there and
    stops (exit 64, saying why) on a Secret that cannot work."""
    for n, (tls, keys, expected) in enumerate([
        (False, [], []),
        (False, ["username", "password"], ["--coordinator-user", "--coordinator-password-file"]),
        (False, ["password"], "username and password go together"),
        (False, ["username"], "username and password go together"),
        (False, ["ca.crt"], "coordinator.tls is false"),
        (True, ["ca.crt"], ["--coordinator-tls-ca"]),
        (True, [], "key ca.crt"),
        (True, ["ca.crt", "tls.crt"], "tls.crt and tls.key go together"),
        (True, ["ca.crt", "tls.key"], "tls.crt and tls.key go together"),
        (True, ["ca.crt", "tls.crt", "tls.key"], ["--coordinator-tls-ca", "--coordinator-tls-cert",
                                                  "--coordinator-tls-key"]),
    ]):  # fmt: skip
        secret = etcd_secret(tmp_path / str(n), keys)
        sts = slots(coordinated(helm, tls=tls))[0]
        done = run_entrypoint(sts, f"{sts['metadata']['name']}-1", stub_dir, secret)
        if isinstance(expected, str):
            assert done.returncode == 64 and expected in done.stderr and "tw-etcd" in done.stderr, done
            continue
        assert done.returncode == 0, done.stderr
        argv = done.stdout.splitlines()
        assert [a for a in argv if a.startswith("--coordinator-")] == expected, (keys, argv)


def test_without_endpoints_the_slots_fail_over_by_silence_as_before(helm: Any, stub_dir: Path) -> None:
    docs = render(helm, {"auth": TOKENS, "coordinator": {"existingSecret": "tw-etcd", "leaseTtl": 9}})
    for sts in slots(docs):
        c = container(sts)
        assert flag_values(c["args"], "--failover-timeout") == ["2"]
        assert not [a for a in c["args"] if a in COORDINATOR_ARGS]
        assert "coordinator" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert COORDINATOR_DIR not in c["command"][2]
        argv = run_entrypoint(sts, f"{sts['metadata']['name']}-1", stub_dir).stdout.splitlines()
        assert "--advertise" not in argv and "--standby" in argv


def test_coordinator_values_that_cannot_work_are_refused(helm: Any) -> None:
    for coordinator, says in [
        ({"endpoints": ["http://etcd:2379"]}, "does not match pattern"),  # HOST:PORT, not a URL
        ({"endpoints": ["etcd:2379/tensorwire"]}, "does not match pattern"),  # the prefix is apart
        ({"endpoints": ["etcd:65536"]}, "does not match pattern"),
        ({"endpoints": ["etcd:2379", "etcd:2379"]}, "are equal"),
        ({"endpoints": [f"etcd-{n}:2379" for n in range(17)]}, "maxItems"),
        ({"prefix": "tensorwire"}, "does not match pattern"),  # no leading /
        ({"prefix": "/tensorwire/"}, "does not match pattern"),
        ({"prefix": "/tensorwire/../other"}, "does not match pattern"),
        ({"prefix": "/tensor wire"}, "does not match pattern"),
        ({"leaseTtl": 1}, "minimum"),  # under etcd's smallest lease with its default timings
        ({"leaseTtl": 2.5}, "want integer"),
        ({"tls": "yes"}, "want boolean"),
        ({"existingSecret": "Tw_Etcd"}, "does not match pattern"),
        ({"ttl": 3}, "additional properties 'ttl'"),
    ]:
        with pytest.raises(helm.HelmError, match=says):
            render(helm, {"auth": TOKENS, "coordinator": coordinator})
    assert slots(render(helm, {"auth": TOKENS, "coordinator": {"endpoints": ["[fd00::1]:2379", "10.0.0.5"]}}))


def test_coordinator_combinations_that_cannot_work_are_refused(helm: Any) -> None:
    for values, says in [
        ({"ps": {"replicas": 0}, "coordinator": {"endpoints": ETCD}}, "needs ps.replicas > 0"),
        ({"coordinator": {"endpoints": ETCD, "tls": True}}, "tls needs coordinator.existingSecret"),
    ]:
        with pytest.raises(helm.HelmError, match=says):
            render(helm, {"auth": TOKENS, **values})


def notes(helm: Any, values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    (text,) = [text for path, text in files.items() if path.endswith("NOTES.txt")]
    return str(text)


def test_the_notes_name_the_leader_keys_and_warn_about_open_credentials(helm: Any) -> None:
    text = notes(helm, COORDINATED)
    assert "etcd elects each slot's primary" in text and "/tensorwire/ml/slots/SLOT/leader" in text
    assert "WARNING" not in text
    plain = notes(helm, {**COORDINATED, "coordinator": {"endpoints": ETCD, "existingSecret": "tw-etcd"}})
    assert "crosses the network to\netcd in plain text" in plain
    open_etcd = notes(helm, {"auth": TOKENS, "coordinator": {"endpoints": ETCD}})
    assert "coordinator.existingSecret is not set" in open_etcd
    assert "etcd" not in notes(helm, {"auth": TOKENS})


def test_tensorwire_accepts_the_coordinated_command_lines(helm: Any, stub_dir: Path, tmp_path: Path) -> None:
    """As test_tensorwire_accepts_every_command_line_the_chart_writes, with every etcd credential."""
    from tensorwire.cli import main

    needs_coordinator_flags()
    secret = etcd_secret(tmp_path, ETCD_KEYS)
    for sts in slots(render(helm, COORDINATED)):
        for ordinal in range(sts["spec"]["replicas"]):
            done = run_entrypoint(sts, f"{sts['metadata']['name']}-{ordinal}", stub_dir, secret)
            parse(main, [stand_in(arg, tmp_path) for arg in done.stdout.splitlines()])
