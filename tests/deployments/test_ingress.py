import subprocess
import sys


def test_the_ingress_process_imports_no_torch():
    """The HTTP ingress runs no model code: admin adds go to a base's replica; names resolve from the manifest."""
    code = ("import sys, serve.app, serve.http.app, serve.deployments.router, serve.deployments.board; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('serve.variants')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_ingress_holds_every_row_the_engines_can_batch(tmp_path):
    """Ray Serve lets a deployment take 5 requests by default: an ingress left at that caps every batch at 5."""
    from serve.app import ingress_options
    from serve.config import ServeConfig

    config = ServeConfig(store=tmp_path)
    rows = config.batch.max_batch_size * config.batch.max_concurrent_groups
    assert ingress_options(config)["max_ongoing_requests"] >= rows
    assert ingress_options(ServeConfig(store=tmp_path, ingress_max_ongoing_requests=7))["max_ongoing_requests"] == 7
