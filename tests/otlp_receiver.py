"""A real OTLP receiver for the tests: an HTTP server on 127.0.0.1 that accepts
``POST /v1/traces`` and ``/v1/metrics`` (http/protobuf) and, when grpcio is installed, a gRPC
server for the same two services. Requests are decoded with ``opentelemetry-proto``; spans and
metric data points are flattened into plain dicts for the assertions."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as msvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which is None:
        return None
    return getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Collected:
    """Everything received so far (thread-safe appends)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.spans: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []  # one entry per metric per export
        self.paths: list[str] = []

    def add_traces(self, req: Any, via: str) -> None:
        with self.lock:
            self.paths.append(via)
            for rs in req.resource_spans:
                resource = _attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            {
                                "name": s.name,
                                "kind": KINDS.get(s.kind, str(s.kind)),
                                "attrs": _attrs(s.attributes),
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent_span_id": s.parent_span_id.hex(),
                                "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                                "status": s.status.code,
                                "status_message": s.status.message,
                                "events": [(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                                "scope": ss.scope.name,
                                "resource": resource,
                                "via": via,
                            }
                        )

    def add_metrics(self, req: Any, via: str) -> None:
        with self.lock:
            self.paths.append(via)
            for rm in req.resource_metrics:
                resource = _attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        points = []
                        for p in getattr(m, kind).data_points:
                            d: dict[str, Any] = {"attrs": _attrs(p.attributes)}
                            if kind == "histogram":
                                d.update(
                                    count=p.count,
                                    sum=p.sum,
                                    bounds=list(p.explicit_bounds),
                                    buckets=list(p.bucket_counts),
                                )
                            else:
                                d["value"] = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
                            points.append(d)
                        self.metrics.append(
                            {
                                "name": m.name,
                                "unit": m.unit,
                                "kind": kind,
                                "points": points,
                                "scope": sm.scope.name,
                                "resource": resource,
                                "via": via,
                            }
                        )

    def latest_metrics(self) -> dict[str, dict[str, Any]]:
        """Each metric's last export (cumulative temporality: the last holds the totals)."""
        with self.lock:
            return {m["name"]: m for m in self.metrics}

    def wait(self, pred: Any, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if pred(self):
                    return True
            time.sleep(0.05)
        with self.lock:
            return bool(pred(self))


class _Handler(BaseHTTPRequestHandler):
    collected: Collected

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        enc = (self.headers.get("Content-Encoding") or "").lower()
        if enc == "gzip":
            body = gzip.decompress(body)
        elif enc == "deflate":
            body = zlib.decompress(body)
        if self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(415)
            return
        if self.path == "/v1/traces":
            req = tsvc.ExportTraceServiceRequest.FromString(body)
            self.collected.add_traces(req, "http")
            out = tsvc.ExportTraceServiceResponse().SerializeToString()
        elif self.path == "/v1/metrics":
            req = msvc.ExportMetricsServiceRequest.FromString(body)
            self.collected.add_metrics(req, "http")
            out = msvc.ExportMetricsServiceResponse().SerializeToString()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


class Receiver:
    """``with Receiver() as r:`` -- ``r.http_endpoint`` (base URL) and, with grpcio,
    ``r.grpc_endpoint``; ``r.collected`` holds what arrived."""

    def __init__(self, grpc: bool = False) -> None:
        self.collected = Collected()
        handler = type("Handler", (_Handler,), {"collected": self.collected})
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.http_endpoint = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.grpc_server: Any = None
        self.grpc_endpoint: str | None = None
        if grpc:
            self._start_grpc()

    def _start_grpc(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

        collected = self.collected

        class Traces(tgrpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
                collected.add_traces(request, "grpc")
                return tsvc.ExportTraceServiceResponse()

        class Metrics(mgrpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                collected.add_metrics(request, "grpc")
                return msvc.ExportMetricsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        tgrpc.add_TraceServiceServicer_to_server(Traces(), server)
        mgrpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.grpc_server = server
        self.grpc_endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.http.shutdown()
        self.http.server_close()
        if self.grpc_server is not None:
            self.grpc_server.stop(0)
