"""The ``prefixgate`` CLI answers a bad argument with one ``prefixgate: …`` line and exit 2, never a
Python traceback (review r12 #3): a missing or non-JSON lint file, a URL without a scheme, an unknown
database URL, a missing or malformed --config."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.admin_client import AdminClient, AdminError

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "lint_missing_file": ["lint", "{tmp}/missing.json", "--api-key", "k", "--url", "http://127.0.0.1:1"],
    "lint_bad_json": ["lint", "{tmp}/bad.json", "--api-key", "k", "--url", "http://127.0.0.1:1"],
    "admin_url_without_scheme": ["tenant", "list", "--url", "gateway.internal", "--admin-token", "t"],
    "db_unknown_url": ["db", "upgrade", "--database-url", "nosuchdb://x", "--data-dir", "{tmp}/d"],
    "gateway_missing_config": ["gateway", "--config", "{tmp}/missing.toml"],
    "gateway_bad_config": ["gateway", "--config", "{tmp}/bad.toml"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_bad_argument_is_one_line_error(tmp_path, case):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.toml").write_text("this is = = not toml\n")
    argv = [arg.format(tmp=tmp_path) for arg in CASES[case]]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefixgate: "), result.stderr


def test_admin_client_bad_url_is_admin_error():
    with pytest.raises(AdminError):
        AdminClient("gateway.internal", "t").request("GET", "/tenants")
