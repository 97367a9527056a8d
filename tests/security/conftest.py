"""Security suite: the attacks of issue 11, each against the real gateway, database and workers."""

from tests.gateway.conftest import (  # noqa: F401 - fixtures shared with the gateway suite
    client,
    config,
    gateway,
    second_worker_url,
    worker_url,
)
from tests.tenancy.db_support import db_url, pg_database, pg_url, sqlite_template, sqlite_url  # noqa: F401
