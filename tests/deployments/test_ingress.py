import subprocess
import sys


def test_the_ingress_process_imports_no_torch():
    """The HTTP ingress runs no model code: admin adds go to a base's replica; names resolve from the manifest."""
    code = ("import sys, serve.app, serve.http.app, serve.deployments.router, serve.deployments.board; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('serve.variants')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
