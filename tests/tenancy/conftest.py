from tests.tenancy.db_support import db_url, pg_database, pg_url, sqlite_template, sqlite_url  # noqa: F401
