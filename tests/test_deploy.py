"""``deploy/`` validated offline: every manifest against the schema its consumer applies, every
``optserve serve`` command line against the CLI, the ServiceMonitor against the Service, and every
PromQL expression of the Grafana dashboard against :data:`optserve.server.ops.metrics.METRICS`.

Each check is also run on a deliberately broken copy, which it must reject.

- Core Kubernetes objects (the Service, the head pod's template): ``kubernetes-validate``'s bundled
  strict schemas (no network), for the oldest Kubernetes with GA gRPC probes and the newest known.
- The ``RayCluster``: KubeRay's CRD (``deploy/schemas/``, the ``v1`` version's OpenAPI schema)
  with ``jsonschema``, unknown fields refused as ``kubectl apply`` (strict field validation) does.
- ``deploy/ray-cluster.yaml``: Ray's own launcher schema, as ``ray up`` prepares and checks it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from optserve.server.ops.metrics import METRICS

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ROOT = DEPLOY.parent
CRD = DEPLOY / "schemas" / "kuberay-v1.7.0-ray.io_rayclusters.yaml"
KUBERNETES_VERSIONS = ("1.27", None)  # gRPC probes are GA from 1.27; None: the newest schemas bundled
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _documents(name: str) -> list[dict]:
    return [d for d in yaml.load_all((DEPLOY / name).read_text(), Loader=_Loader) if d]


def _one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d.get("kind") == kind]
    return found


@pytest.fixture(scope="module")
def kuberay():
    return _documents("kuberay-raycluster.yaml")


@pytest.fixture(scope="module")
def raycluster(kuberay):
    return _one(kuberay, "RayCluster")


@pytest.fixture(scope="module")
def service(kuberay):
    return _one(kuberay, "Service")


@pytest.fixture(scope="module")
def servicemonitor():
    (monitor,) = _documents("servicemonitor.yaml")
    return monitor


def _container(raycluster: dict, name: str) -> dict:
    (found,) = [c for c in raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def _named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", ())}


# ---------------------------------------------------------------------------------------------
# Core Kubernetes objects: kubernetes-validate (bundled, strict schemas)


def _k8s_errors(obj: dict) -> list[str]:
    import kubernetes_validate

    errors = []
    for version in KUBERNETES_VERSIONS:
        version = version or kubernetes_validate.latest_version()
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"k8s {version}: {'.'.join(map(str, exc.path))}: {exc.message}")
    return errors


def _pod_template(raycluster: dict, group: str = "head") -> dict:
    spec = raycluster["spec"]
    template = spec["headGroupSpec"]["template"] if group == "head" else \
        next(g for g in spec["workerGroupSpecs"] if g["groupName"] == group)["template"]
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"optserve-{group}"},
            "template": template}


def test_kubernetes_validate_runs_offline_with_bundled_schemas():
    import kubernetes_validate

    assert kubernetes_validate.latest_version() >= "1.27"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # it knows core kinds only
        kubernetes_validate.validate({"apiVersion": "ray.io/v1", "kind": "RayCluster"}, "1.27", strict=True)


def test_the_service_and_the_pod_templates_are_valid_kubernetes_objects(service, raycluster):
    assert _k8s_errors(service) == []
    assert _k8s_errors(_pod_template(raycluster, "head")) == []
    for group in raycluster["spec"]["workerGroupSpecs"]:
        assert _k8s_errors(_pod_template(raycluster, group["groupName"])) == []


def test_kubernetes_validation_rejects_a_typo_and_a_wrong_type(service, raycluster):
    broken = copy.deepcopy(service)
    broken["spec"]["ports"][0]["targetPrt"] = broken["spec"]["ports"][0].pop("targetPort")
    assert any("targetPrt" in e for e in _k8s_errors(broken))
    pod = _pod_template(copy.deepcopy(raycluster))
    optserve = next(c for c in pod["template"]["spec"]["containers"] if c["name"] == "optserve")
    optserve["readinessProbe"]["grpc"]["port"] = "fifty"
    assert _k8s_errors(pod)


# ---------------------------------------------------------------------------------------------
# The RayCluster: KubeRay's CRD schema


def _strict(schema):
    """The CRD's structural schema with unknown fields refused (``kubectl apply``'s strict field
    validation; the API server would otherwise prune them silently)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def raycluster_validator():
    (crd,) = _documents(f"schemas/{CRD.name}")
    assert (crd["kind"], crd["spec"]["group"], crd["spec"]["names"]["kind"]) == \
        ("CustomResourceDefinition", "ray.io", "RayCluster")
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return jsonschema.Draft4Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def _raycluster_errors(validator, obj: dict) -> list[str]:
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    if obj.get("apiVersion") != "ray.io/v1" or obj.get("kind") != "RayCluster":
        errors.append(f"not a ray.io/v1 RayCluster: {obj.get('apiVersion')} {obj.get('kind')}")
    return errors


def test_the_raycluster_matches_kuberays_crd(raycluster_validator, raycluster):
    assert _raycluster_errors(raycluster_validator, raycluster) == []


def test_the_crd_check_rejects_a_typo_a_wrong_type_and_a_wrong_api_version(raycluster_validator, raycluster):
    typo = copy.deepcopy(raycluster)
    typo["spec"]["headGroupSpec"]["rayStartParam"] = typo["spec"]["headGroupSpec"].pop("rayStartParams")
    assert any("rayStartParam" in e for e in _raycluster_errors(raycluster_validator, typo))
    wrong_type = copy.deepcopy(raycluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert _raycluster_errors(raycluster_validator, wrong_type)
    probe = copy.deepcopy(raycluster)
    _container(probe, "optserve")["livenessProbe"]["grpc"]["prot"] = 50052
    assert any("prot" in e for e in _raycluster_errors(raycluster_validator, probe))
    old = dict(raycluster, apiVersion="ray.io/v1alpha1")
    assert _raycluster_errors(raycluster_validator, old)


def test_the_raycluster_runs_the_pinned_ray(raycluster):
    (pin,) = re.findall(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert raycluster["spec"]["rayVersion"] == pin


# ---------------------------------------------------------------------------------------------
# optserve's command lines: the CLI parses them; ports, probes, Service and scrape config agree


def _serve_argv(command: str) -> list[str]:
    """The arguments after ``optserve serve`` in a shell command (up to a redirection or ``&``)."""
    tokens = shlex.split(command, comments=False)
    start = next(i for i in range(len(tokens) - 1) if tokens[i].endswith("optserve") and tokens[i + 1] == "serve")
    argv = []
    for token in tokens[start + 1:]:
        if token in (">", ">>", "&", "&&", ";", "|") or token.startswith(("2>", ">")):
            break
        argv.append(token)
    return argv


def _parse_serve(argv: list[str]):
    """``optserve serve``'s parsed flags; an unknown flag or a bad value fails, naming it."""
    from optserve.server.cli import _parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return _parser().parse_args(argv)
    except SystemExit:  # argparse's way of refusing: its message went to stderr
        raise ValueError(stderr.getvalue().strip().splitlines()[-1]) from None


def _kuberay_serve_argv(raycluster: dict) -> list[str]:
    return _serve_argv(" ".join(_container(raycluster, "optserve")["args"]))


def test_every_optserve_command_line_in_deploy_parses(raycluster):
    commands = {"kuberay": _kuberay_serve_argv(raycluster)}
    launcher = yaml.load((DEPLOY / "ray-cluster.yaml").read_text(), Loader=_Loader)
    (head_serve,) = [c for c in launcher["head_start_ray_commands"] if "optserve serve" in c]
    commands["ray-cluster"] = _serve_argv(head_serve)
    (cmd,) = re.findall(r"^CMD (\[.*?\])\s*$", (DEPLOY / "Dockerfile").read_text().replace("\\\n", ""), re.M | re.S)
    commands["Dockerfile"] = json.loads(cmd)
    for where, argv in commands.items():
        try:
            args = _parse_serve(argv)
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}")
        assert args.command == "serve", where
        assert args.metrics_port == 9090 and args.metrics_host == "0.0.0.0", where


def test_the_command_line_check_rejects_an_unknown_flag_and_a_bad_value():
    with pytest.raises(ValueError, match="--metrics-prot"):
        _parse_serve(["serve", "--metrics-prot", "9090"])
    with pytest.raises(ValueError, match="--shards"):
        _parse_serve(["serve", "--shards", "four"])


def test_ports_probes_service_and_scrape_annotations_agree(raycluster, service):
    optserve = _container(raycluster, "optserve")
    ports = _named_ports(optserve)
    args = _parse_serve(_kuberay_serve_argv(raycluster))
    assert ports["control"] == args.port == 50051
    assert ports["metrics"] == args.metrics_port
    # native gRPC probes (grpc.health.v1.Health) on a port the container declares, served plaintext
    # (the kubelet's gRPC probe speaks no TLS) by `--health-port`
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(optserve[probe]) - {"grpc", "periodSeconds", "timeoutSeconds", "failureThreshold",
                                       "initialDelaySeconds", "successThreshold"} == set(), probe
        assert optserve[probe]["grpc"]["port"] == ports["health"] == getattr(args, "health_port", None), probe
    # the Service reaches the head pod's named ports
    assert service["spec"]["selector"] == {"ray.io/cluster": raycluster["metadata"]["name"], "ray.io/node-type": "head"}
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(by_name) == {"control", "metrics"}
    for name, port in by_name.items():
        assert port["targetPort"] in (name, ports[name]) and port["port"] == ports[name], name
    # scrape annotations on the Service and the pod name the metrics port and path
    pod_annotations = raycluster["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    for annotations in (service["metadata"]["annotations"], pod_annotations):
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(args.metrics_port)
        assert annotations["prometheus.io/path"] == "/metrics"
    # TLS material and tokens still come from the mounted Secret
    mounts = {m["name"]: m["mountPath"] for m in optserve["volumeMounts"]}
    volumes = {v["name"]: v for v in raycluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert "secretName" in volumes["optserve-secrets"]["secret"]
    for path in (args.tls_cert, args.tls_key, args.auth_tokens):
        assert path and path.startswith(mounts["optserve-secrets"] + "/"), path


# ---------------------------------------------------------------------------------------------
# The ServiceMonitor: structurally, against the Service


def _servicemonitor_errors(monitor: dict, service: dict) -> list[str]:
    errors = []
    if monitor.get("apiVersion") != "monitoring.coreos.com/v1" or monitor.get("kind") != "ServiceMonitor":
        errors.append(f"not a monitoring.coreos.com/v1 ServiceMonitor: {monitor.get('apiVersion')} {monitor.get('kind')}")
    spec = monitor.get("spec", {})
    unknown = set(spec) - {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels"}
    if unknown:
        errors.append(f"unknown spec fields: {sorted(unknown)}")
    selector = spec.get("selector", {})
    labels = service.get("metadata", {}).get("labels", {})
    match = selector.get("matchLabels")
    if not match or set(selector) - {"matchLabels", "matchExpressions"}:
        errors.append(f"selector must be matchLabels: {selector}")
    elif any(labels.get(k) != v for k, v in match.items()):
        errors.append(f"selector {match} does not match the Service's labels {labels}")
    port_names = {p.get("name") for p in service.get("spec", {}).get("ports", ())}
    endpoints = spec.get("endpoints") or []
    if not endpoints:
        errors.append("no endpoints")
    for endpoint in endpoints:
        if endpoint.get("port") not in port_names:
            errors.append(f"endpoint port {endpoint.get('port')!r} is not a Service port name {sorted(port_names)}")
        if endpoint.get("path", "/metrics") != "/metrics":
            errors.append(f"endpoint path {endpoint.get('path')!r} is not /metrics")
        if endpoint.get("scheme", "http") != "http":
            errors.append("the metrics endpoint speaks http")
        if set(endpoint) - {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "relabelings",
                            "metricRelabelings"}:
            errors.append(f"unknown endpoint fields: {sorted(endpoint)}")
    return errors


def test_the_servicemonitor_selects_the_service_and_scrapes_its_metrics_port(servicemonitor, service):
    assert _servicemonitor_errors(servicemonitor, service) == []
    assert servicemonitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_the_servicemonitor_check_rejects_a_wrong_port_selector_or_kind(servicemonitor, service):
    port = copy.deepcopy(servicemonitor)
    port["spec"]["endpoints"][0]["port"] = "metric"
    assert any("'metric'" in e for e in _servicemonitor_errors(port, service))
    selector = copy.deepcopy(servicemonitor)
    selector["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": "optserv"}
    assert _servicemonitor_errors(selector, service)
    kind = dict(servicemonitor, apiVersion="monitoring.coreos.com/v1alpha1")
    assert _servicemonitor_errors(kind, service)


# ---------------------------------------------------------------------------------------------
# deploy/ray-cluster.yaml: Ray's launcher schema, as `ray up` prepares and validates it


def _launcher_errors(config: dict) -> list[str]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except (jsonschema.ValidationError, ValueError) as exc:
        return [str(getattr(exc, "message", exc))]
    return []


def test_the_ray_launcher_config_is_valid_and_a_typo_is_not():
    config = yaml.load((DEPLOY / "ray-cluster.yaml").read_text(), Loader=_Loader)
    assert _launcher_errors(config) == []
    broken = dict(config)
    broken["setup_comands"] = broken.pop("setup_commands")
    assert any("setup_comands" in e for e in _launcher_errors(broken))


# ---------------------------------------------------------------------------------------------
# The Grafana dashboard: PromQL over METRICS only

_PROMQL_WORDS = {
    # aggregations and their modifiers, operators, keywords
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "atan2",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_quantile",
    "histogram_count", "histogram_sum", "histogram_fraction", "holt_winters", "hour", "idelta", "increase",
    "irate", "label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate",
    "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time",
    # Grafana's templating functions
    "label_values", "label_names", "metrics", "query_result",
}
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def _series(name: str):
    """The METRICS entry a series name belongs to, or None (histograms only with a suffix)."""
    for metric, (kind, labels, _) in METRICS.items():
        for suffix in _SUFFIXES[kind]:
            if name == metric + suffix:
                return metric, labels, suffix
    return None


def _promql_errors(expr: str) -> list[str]:
    """Names in ``expr`` that are not series of METRICS, and labels those series do not carry."""
    errors = []
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\$\{?\w+(?::\w+)?\}?", " 1 ", e)  # Grafana variables ($session, $__rate_interval)
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range selectors and subqueries
    labels_used = set()
    for block in re.findall(r"\{([^}]*)\}", e):  # label matchers
        labels_used |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", block))
    e = re.sub(r"\{[^}]*\}", " ", e)
    for block in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", e):
        labels_used |= {label.strip() for label in block.split(",") if label.strip()}
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    for _, label in re.findall(r"\blabel_values\s*\(([^,()]+),\s*([A-Za-z_]\w*)\s*\)", e):
        labels_used.add(label)
    e = re.sub(r"(\blabel_values\s*\([^,()]+),\s*[A-Za-z_]\w*\s*\)", r"\1)", e)
    e = re.sub(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", " ", e)  # numbers
    carried = {"le", "instance", "job"}
    names = [w for w in re.findall(r"[A-Za-z_:][\w:]*", e) if w not in _PROMQL_WORDS]
    if not names:
        errors.append(f"no optserve series in {expr!r}")
    for name in names:
        found = _series(name)
        if found is None:
            errors.append(f"{name!r} is not a series of METRICS")
        else:
            carried |= set(found[1])
    for label in labels_used - carried:
        errors.append(f"label {label!r} is not carried by the series of {expr!r}")
    return errors


def _dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    queries = []

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", ()))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", ()):
            queries.append((panel["title"], target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", ()):
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append((f"${variable['name']}", query["query"] if isinstance(query, dict) else query))
    return queries


def _dashboard_errors(dashboard: dict) -> list[str]:
    return [f"{where}: {error}" for where, expr in _dashboard_queries(dashboard) for error in _promql_errors(expr)]


@pytest.fixture(scope="module")
def dashboard():
    return json.loads((DEPLOY / "grafana-dashboard.json").read_text())


def test_every_dashboard_query_names_only_metrics_of_the_server(dashboard):
    assert _dashboard_errors(dashboard) == []


def test_the_dashboard_shows_every_metric_and_its_panels_are_well_formed(dashboard):
    used = {_series(name)[0] for _, expr in _dashboard_queries(dashboard)
            for name in re.findall(r"\boptserve_\w+", expr) if _series(name)}
    assert used == set(METRICS), f"metrics without a panel: {sorted(set(METRICS) - used)}"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
    titles = " | ".join(p["title"] for p in panels).lower()
    for needed in ("step latency", "push latency", "pull latency", "steps applied", "rejected", "staleness",
                   "session version", "loss", "bytes in / out", "optimizer-state bytes", "rss", "root age", "root error"):
        assert needed in titles, needed


@pytest.mark.parametrize("expr, wrong", [
    ("rate(optserve_step_second_bucket[5m])", "optserve_step_second_bucket"),  # a typo
    ("sum(rate(optserve_step_seconds[5m]))", "optserve_step_seconds"),  # a histogram without a suffix
    ("optserve_steps_applied", "optserve_steps_applied"),  # a counter without _total
    ("process_resident_memory_bytes", "process_resident_memory_bytes"),  # not optserve's
    ("sum by (sesion) (optserve_param_bytes)", "sesion"),  # an unknown label
    ("sum by (shard) (optserve_session_version)", "shard"),  # a label the series does not carry
])
def test_the_promql_check_rejects(expr, wrong):
    errors = _promql_errors(expr)
    assert any(wrong in e for e in errors), errors


def test_the_dashboard_check_rejects_an_unknown_metric_in_a_panel(dashboard):
    broken = copy.deepcopy(dashboard)
    target = next(p for p in broken["panels"] if p["type"] != "row")["targets"][0]
    target["expr"] = target["expr"].replace("optserve_", "optserv_", 1)
    assert len(_dashboard_errors(broken)) == 1
    variable = copy.deepcopy(dashboard)
    variable["templating"]["list"][1]["query"]["query"] = "label_values(optserve_session_versions, session)"
    assert any("optserve_session_versions" in e for e in _dashboard_errors(variable))
