from pathlib import Path

import pytest

from xgenconsole.env import (
    ImproperEnv,
    database_from_url,
    env_bool,
    env_dirs,
    env_int,
    env_secret,
    persistent_secret_key,
)


def test_env_bool_takes_only_true_or_false(monkeypatch):
    monkeypatch.setenv("X_FLAG", "TRUE")
    assert env_bool("X_FLAG", False) is True
    monkeypatch.setenv("X_FLAG", "false")
    assert env_bool("X_FLAG", True) is False
    for bad in ("yes", "1", "on", "no"):
        monkeypatch.setenv("X_FLAG", bad)
        with pytest.raises(ImproperEnv, match="X_FLAG"):
            env_bool("X_FLAG", False)
    monkeypatch.delenv("X_FLAG")
    assert env_bool("X_FLAG", True) is True


def test_env_int_checks_type_and_bounds(monkeypatch):
    monkeypatch.setenv("X_N", "12")
    assert env_int("X_N", 1) == 12
    monkeypatch.setenv("X_N", "twelve")
    with pytest.raises(ImproperEnv, match="integer"):
        env_int("X_N", 1)
    monkeypatch.setenv("X_N", "0")
    with pytest.raises(ImproperEnv, match=">= 1"):
        env_int("X_N", 5, minimum=1)


def test_env_secret_reads_the_file_variant(monkeypatch, tmp_path: Path):
    secret = tmp_path / "s"
    secret.write_text("from-file\n")
    monkeypatch.delenv("X_SECRET", raising=False)
    monkeypatch.setenv("X_SECRET_FILE", str(secret))
    assert env_secret("X_SECRET") == "from-file"
    monkeypatch.setenv("X_SECRET", "direct")
    assert env_secret("X_SECRET") == "direct"
    monkeypatch.delenv("X_SECRET")
    monkeypatch.setenv("X_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperEnv, match="cannot be read"):
        env_secret("X_SECRET")


def test_env_dirs_takes_absolute_folders_outside_the_consoles_own(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("X_DIRS", raising=False)
    assert env_dirs("X_DIRS") == []
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("X_DIRS", f" {tmp_path / 'link'} ,, {tmp_path / 'b'} ")
    assert env_dirs("X_DIRS") == [(tmp_path / "real").resolve(), (tmp_path / "b").resolve()]
    monkeypatch.setenv("X_DIRS", f"{tmp_path},models")
    with pytest.raises(ImproperEnv, match="absolute paths only"):
        env_dirs("X_DIRS")
    data = tmp_path / "data"
    for inside in (data, data / "imports"):
        monkeypatch.setenv("X_DIRS", str(inside))
        with pytest.raises(ImproperEnv, match="inside XGEN_DATA_DIR"):
            env_dirs("X_DIRS", not_inside={"XGEN_DATA_DIR": data})
    monkeypatch.setenv("X_DIRS", str(tmp_path))  # a folder above the data dir is allowed here
    assert env_dirs("X_DIRS", not_inside={"XGEN_DATA_DIR": data}) == [tmp_path.resolve()]


def test_secret_key_is_generated_once_and_private(tmp_path: Path):
    first = persistent_secret_key(tmp_path)
    assert len(first) > 40
    assert persistent_secret_key(tmp_path) == first
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600


def test_database_url_parsing(tmp_path: Path):
    assert database_from_url("", data_dir=tmp_path)["NAME"] == str(tmp_path / "xgen.sqlite3")
    pg = database_from_url("postgres://u:p%40ss@db.local:5433/xgen?sslmode=require", data_dir=tmp_path)
    assert pg["ENGINE"] == "django.db.backends.postgresql"
    assert (pg["USER"], pg["PASSWORD"], pg["HOST"], pg["PORT"], pg["NAME"]) == ("u", "p@ss", "db.local", "5433", "xgen")
    assert pg["OPTIONS"] == {"sslmode": "require", "connect_timeout": "5"}
    assert pg["CONN_HEALTH_CHECKS"] is True
    assert database_from_url("postgres://h/x?connect_timeout=30", data_dir=tmp_path)["OPTIONS"]["connect_timeout"] == "30"
    with pytest.raises(ImproperEnv, match="mysql"):
        database_from_url("mysql://x/y", data_dir=tmp_path)
