"""Settings for the test run: a throwaway data dir, so tests never touch ./data."""
import atexit
import os
import shutil
import tempfile

_tmp = tempfile.mkdtemp(prefix="xgen-test-")
os.environ["XGEN_DATA_DIR"] = _tmp
# Tests upload from their tmp dirs (pytest's basetemp lies under the system temp dir); the
# console's own dirs stay refused inside it. Tests of the rule set settings.IMPORT_DIRS themselves.
os.environ["XGEN_IMPORT_DIRS"] = tempfile.gettempdir()
os.environ.setdefault("XGEN_DEMO_MODEL", "false")
atexit.register(shutil.rmtree, _tmp, True)

from xgenconsole.settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast in tests only

# In-process tests' event loops come and go: the routing table reads the database when stale
# instead of refreshing in a background task bound to one test's loop (consoles the tests start
# as processes use the real settings, push included).
PROXY_ROUTING_PUSH = False
