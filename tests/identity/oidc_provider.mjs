// A real OpenID provider for the tests: the npm package oidc-provider (OpenID-certified) with a small
// config (argv[2], JSON: issuer, port, clients, keys, accounts). Its dev interactions give the login
// and consent pages. /test/* lets a test change accounts (groups, disabled) and the next ID token
// (to check the console refuses them: a payload changed after signing, or one re-signed with the
// provider's own key for another audience or expired).
import fs from 'node:fs';
import http from 'node:http';
import * as jose from 'jose';
import Provider from 'oidc-provider';

const cfg = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const accounts = cfg.accounts;
const next = { mode: null };

const provider = new Provider(cfg.issuer, {
  clients: cfg.clients,
  jwks: { keys: cfg.keys },
  cookies: { keys: ['xgen-test-cookie-key'] },
  pkce: { required: () => true },
  scopes: ['openid', 'offline_access', 'profile', 'email', 'groups'],
  claims: { openid: ['sub'], profile: ['name', 'preferred_username'], email: ['email'], groups: ['groups'] },
  conformIdTokenClaims: false, // the groups go in the ID token, as Entra ID, Okta and Keycloak can do
  features: { devInteractions: { enabled: true } },
  ttl: { IdToken: 3600, AccessToken: 600, RefreshToken: 3600, Grant: 3600,
         Interaction: 600, Session: 3600, AuthorizationCode: 60 },
  issueRefreshToken: async (ctx, client) => client.grantTypeAllowed('refresh_token'),
  async findAccount(ctx, id) {
    const a = accounts[id];
    if (!a || a.disabled) return undefined; // a refresh for this subject is refused: invalid_grant
    return {
      accountId: id,
      async claims() {
        const c = { sub: id, preferred_username: id, email: a.email || `${id}@example.test`, name: id };
        if (a.groups !== undefined) c.groups = a.groups;
        return c;
      },
    };
  },
});

provider.on('server_error', (ctx, err) => console.error('server_error', err));
const b64 = (obj) => Buffer.from(JSON.stringify(obj)).toString('base64url');
provider.use(async (ctx, nxt) => {
  await nxt();
  if (ctx.oidc?.route !== 'token' || !ctx.body?.id_token || !next.mode) return;
  const [header, payload, signature] = ctx.body.id_token.split('.');
  const claims = JSON.parse(Buffer.from(payload, 'base64url').toString());
  if (next.mode === 'tamper') {
    claims.groups = ['xgen-admins']; // a payload changed after signing: the signature no longer matches
    ctx.body.id_token = `${header}.${b64(claims)}.${signature}`;
  } else {
    // Re-signed with the provider's own key: for another client, or expired 5 minutes ago.
    const { kid, alg } = JSON.parse(Buffer.from(header, 'base64url').toString());
    const jwk = cfg.keys.find((k) => k.kid === kid);
    const now = Math.floor(Date.now() / 1000);
    // azp kept as this client: a token another client was given, naming us as the party it was for.
    if (next.mode === 'audience') Object.assign(claims, { aud: 'another-client', azp: claims.aud });
    if (next.mode === 'expired') Object.assign(claims, { iat: now - 900, exp: now - 300 });
    ctx.body.id_token = await new jose.SignJWT(claims).setProtectedHeader({ alg, kid, typ: 'JWT' })
      .sign(await jose.importJWK(jwk, alg));
  }
  next.mode = null;
});

const callback = provider.callback();
http.createServer((req, res) => {
  if (!req.url.startsWith('/test/')) return callback(req, res);
  let body = '';
  req.on('data', (chunk) => { body += chunk; });
  req.on('end', () => {
    const data = body ? JSON.parse(body) : {};
    if (req.url === '/test/accounts') Object.assign(accounts, data);
    else if (req.url === '/test/next-id-token') Object.assign(next, data);
    res.writeHead(200, { 'content-type': 'application/json' });
    res.end(JSON.stringify({ accounts, next }));
  });
}).listen(cfg.port, '127.0.0.1', () => console.log(`listening on ${cfg.port}`));
