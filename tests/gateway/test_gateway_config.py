import stat
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, load_config, prepare_data_dir
from policies.promotion import PromotionPolicy


def test_precedence_defaults_file_env_flags(tmp_path: Path):
    config_file = tmp_path / "prefixgate.toml"
    config_file.write_text(
        '[gateway]\nport = 9000\nworker_urls = ["http://a:1/", "http://b:2"]\n'
        "price_output_per_mtok = 5\ndefault_max_tokens = 64\n"
    )
    env = {
        "PREFIXGATE_PORT": "9100",
        "PREFIXGATE_POLICY_REFRESH_S": "0.25",
        "PREFIXGATE_CONFIG": str(config_file),
    }
    config = load_config(env=env, overrides={"port": 9200, "host": None})
    assert config.port == 9200 and config.host == "127.0.0.1"
    assert config.worker_urls == ("http://a:1", "http://b:2")
    assert config.price_output_per_mtok == 5.0 and config.default_max_tokens == 64
    assert config.policy_refresh_s == 0.25
    assert load_config(env={"PREFIXGATE_WORKER_URLS": "http://x:1, http://y:2"}).worker_urls == (
        "http://x:1",
        "http://y:2",
    )
    with pytest.raises(dataclasses_error()):
        config.port = 1


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_unknown_config_key_is_an_error(tmp_path: Path):
    config_file = tmp_path / "c.toml"
    config_file.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        load_config(config_file=config_file, env={})


def test_prepare_data_dir_generates_and_keeps_secrets(tmp_path: Path):
    config = prepare_data_dir(GatewayConfig(data_dir=tmp_path / "d"))
    # The namespace secret is the deployment's (database), never a per-data-dir file.
    assert config.admin_token and not config.namespace_salt
    assert not (tmp_path / "d" / "namespace_salt").exists()
    assert stat.S_IMODE((tmp_path / "d" / "admin_token").stat().st_mode) == 0o600
    again = prepare_data_dir(GatewayConfig(data_dir=tmp_path / "d"))
    assert again.admin_token == config.admin_token
    given = prepare_data_dir(GatewayConfig(data_dir=tmp_path / "d", admin_token="mine"))
    assert given.admin_token == "mine"
    assert "namespace_salt" not in repr(config)
    assert config.resolved_database_url.startswith(
        "sqlite+aiosqlite:///"
    ) and config.resolved_database_url.endswith("d/prefixgate.db")


@pytest.mark.parametrize(("min_hits", "min_tenants"), [(2, 3), (2, 1), (4, 5)])
def test_a_promotion_threshold_k_minus_1_tenants_make_alone_is_refused(min_hits, min_tenants):
    # k−1 tenants of one party at their cap would make the hits alone, and one request of a victim would
    # complete the promotion (review r3, D5); below k hits a share under one hit still counts one.
    env = {
        "PREFIXGATE_PROMOTION_MIN_HITS": str(min_hits),
        "PREFIXGATE_PROMOTION_MIN_TENANTS": str(min_tenants),
    }
    with pytest.raises(ValueError, match="PREFIXGATE_PROMOTION_MIN_HITS"):
        load_config(env=env)
    with pytest.raises(ValueError, match="too low"):
        PromotionPolicy.from_env(env)
    assert load_config(env={**env, "PREFIXGATE_PROMOTION_MIN_HITS": "1000"}).promotion_min_hits == 1000


def test_a_delete_waits_two_policy_polls_and_no_longer_than_its_bound(tmp_path: Path):
    """Review r22: the delete's fence covers every replica's next policy poll, within a bound."""
    assert load_config(env={}, overrides={"data_dir": tmp_path}).delete_fence_s == 1.5
    slow = load_config(env={"PREFIXGATE_POLICY_REFRESH_S": "30"}, overrides={"data_dir": tmp_path})
    assert slow.delete_fence_s == 10.0
    env = {"PREFIXGATE_POLICY_REFRESH_S": "30", "PREFIXGATE_DELETE_FENCE_MAX_S": "90"}
    assert load_config(env=env, overrides={"data_dir": tmp_path}).delete_fence_s == 60.5
