import pytest
from django.core.management import CommandError, call_command

from accounts.models import ApiKey, User, hash_key


@pytest.mark.django_db
def test_createuser_and_createapikey(capsys):
    call_command("createuser", "--username", "ops", "--role", "operator", "--password", "long-enough-1")
    assert User.objects.get(username="ops").role == "operator"
    capsys.readouterr()
    call_command("createapikey", "--username", "ops")
    raw = capsys.readouterr().out.strip()
    assert ApiKey.objects.get(key_hash=hash_key(raw)).user.username == "ops"


@pytest.mark.django_db
def test_createuser_refuses_bad_input():
    with pytest.raises(CommandError):
        call_command("createuser", "--username", "x", "--role", "operator", "--password", "short")
    call_command("createuser", "--username", "x", "--role", "viewer", "--password", "long-enough-1")
    with pytest.raises(CommandError, match="exists"):
        call_command("createuser", "--username", "x", "--role", "viewer", "--password", "long-enough-1")
    with pytest.raises(CommandError, match="no user"):
        call_command("createapikey", "--username", "ghost")


@pytest.mark.django_db
def test_ensureadmin_generates_a_password_once(capsys, monkeypatch):
    monkeypatch.delenv("XGEN_ADMIN_PASSWORD", raising=False)
    call_command("ensureadmin")
    out = capsys.readouterr().out
    password = out.split("password: ")[1].split()[0]
    assert User.objects.get(username="admin").check_password(password)
    call_command("ensureadmin")
    assert "nothing to do" in capsys.readouterr().out
