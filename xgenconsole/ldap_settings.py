"""django-auth-ldap's AUTH_LDAP_* settings from the XGEN_LDAP_* environment (read only when
XGEN_LDAP_URL is set, so python-ldap is imported only where LDAP is used)."""
from __future__ import annotations

from xgenconsole.env import ImproperEnv, env_bool, env_int, env_str

GROUP_TYPES = ("groupOfNames", "groupOfUniqueNames", "posixGroup", "activeDirectory", "nestedActiveDirectory")
DEFAULT_GROUP_FILTERS = {
    "groupOfNames": "(objectClass=groupOfNames)",
    "groupOfUniqueNames": "(objectClass=groupOfUniqueNames)",
    "posixGroup": "(objectClass=posixGroup)",
    "activeDirectory": "(objectClass=group)",
    "nestedActiveDirectory": "(objectClass=group)",
}


def group_type(name: str):
    from django_auth_ldap import config

    return {
        "groupOfNames": config.GroupOfNamesType,
        "groupOfUniqueNames": config.GroupOfUniqueNamesType,
        "posixGroup": config.PosixGroupType,
        "activeDirectory": config.ActiveDirectoryGroupType,
        "nestedActiveDirectory": config.NestedActiveDirectoryGroupType,
    }[name]()


def ldap_settings() -> dict:
    import ldap
    from django_auth_ldap.config import LDAPSearch

    out: dict = {
        "AUTH_LDAP_USER_ATTR_MAP": {"first_name": "givenName", "last_name": "sn", "email": "mail"},
        "AUTH_LDAP_ALWAYS_UPDATE_USER": True,
        "AUTH_LDAP_MIRROR_GROUPS": False,
        "AUTH_LDAP_FIND_GROUP_PERMS": False,
        "AUTH_LDAP_CACHE_TIMEOUT": 0,  # group lookups are fresh at each sign-in and each session check
        "AUTH_LDAP_CONNECTION_OPTIONS": {
            ldap.OPT_NETWORK_TIMEOUT: env_int("XGEN_LDAP_TIMEOUT_S", 5, minimum=1, maximum=120),
            ldap.OPT_TIMEOUT: env_int("XGEN_LDAP_TIMEOUT_S", 5, minimum=1, maximum=120),
            ldap.OPT_REFERRALS: 0,  # Active Directory's referrals need a bind of their own
        },
    }
    ca_file = env_str("XGEN_LDAP_CA_FILE")
    if ca_file:  # on each connection, then a new TLS context that takes it (OpenLDAP's order)
        out["AUTH_LDAP_CONNECTION_OPTIONS"].update({ldap.OPT_X_TLS_CACERTFILE: ca_file, ldap.OPT_X_TLS_NEWCTX: 0})
    dn_template = env_str("XGEN_LDAP_USER_DN_TEMPLATE")  # e.g. uid=%(user)s,ou=people,dc=example,dc=org
    base = env_str("XGEN_LDAP_USER_SEARCH_BASE")
    if dn_template:
        out["AUTH_LDAP_USER_DN_TEMPLATE"] = dn_template
    elif base:
        out["AUTH_LDAP_USER_SEARCH"] = LDAPSearch(base, ldap.SCOPE_SUBTREE,
                                                  env_str("XGEN_LDAP_USER_FILTER", "(uid=%(user)s)"))
    else:
        raise ImproperEnv("XGEN_LDAP_URL needs XGEN_LDAP_USER_SEARCH_BASE or XGEN_LDAP_USER_DN_TEMPLATE")
    group_base = env_str("XGEN_LDAP_GROUP_SEARCH_BASE")
    if group_base:
        kind = env_str("XGEN_LDAP_GROUP_TYPE", "groupOfNames")
        if kind not in GROUP_TYPES:
            raise ImproperEnv(f"XGEN_LDAP_GROUP_TYPE must be one of {', '.join(GROUP_TYPES)}, not {kind!r}")
        default_filter = DEFAULT_GROUP_FILTERS[kind]
        out["AUTH_LDAP_GROUP_SEARCH"] = LDAPSearch(group_base, ldap.SCOPE_SUBTREE,
                                                   env_str("XGEN_LDAP_GROUP_FILTER", default_filter))
        out["AUTH_LDAP_GROUP_TYPE"] = group_type(kind)
    require = env_str("XGEN_LDAP_REQUIRE_GROUP")  # a group DN: only its members may sign in
    if require:
        out["AUTH_LDAP_REQUIRE_GROUP"] = require
    if env_bool("XGEN_LDAP_START_TLS", False) and env_str("XGEN_LDAP_URL").lower().startswith("ldaps://"):
        raise ImproperEnv("XGEN_LDAP_START_TLS is for ldap:// URLs; an ldaps:// URL is TLS from the start")
    return out
