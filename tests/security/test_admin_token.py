"""The admin token is printed when it is created, never again (issue 11: it was printed on every start)."""

from gateway.config import GatewayConfig
from gateway.up import _banner


def test_the_admin_token_is_shown_only_when_it_was_created(tmp_path):
    config = GatewayConfig(data_dir=tmp_path, admin_token="adm-secret-token", namespace_salt="s")
    first = _banner(config, "m", "sk-demo", False, admin_token_created=True)
    assert "adm-secret-token" in first
    later = _banner(config, "m", None, False, admin_token_created=False)
    assert "adm-secret-token" not in later and str(tmp_path / "admin_token") in later
    from_env = _banner(config, "m", None, True, admin_token_created=False)
    assert "adm-secret-token" not in from_env
