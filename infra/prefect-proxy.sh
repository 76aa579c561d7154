#!/usr/bin/env bash
# The reverse proxy in front of the Prefect server: nginx with infra/nginx/prefect-proxy.conf (docs/security.md).
#   bash infra/prefect-proxy.sh add-user NAME operator|runner   # new credential: NAME:<random>, in a 0600 file
#   bash infra/prefect-proxy.sh run               # in the foreground (systemd)
#   bash infra/prefect-proxy.sh start             # in the background; prints the PREFECT_API_URL to use
#   bash infra/prefect-proxy.sh stop              # the one `start` started
#   bash infra/prefect-proxy.sh install           # only install nginx and its njs module (pinned; as root, apt-get)
# Settings: DATAGEN_PROXY_DIR (state: rendered config, users.map, credentials; default <checkout>/.datagen/prefect-proxy,
# 0700), DATAGEN_PROXY_LISTEN (default 127.0.0.1:4300), DATAGEN_PROXY_UPSTREAM (the server, default 127.0.0.1:4200),
# DATAGEN_PROXY_TLS_CERT / DATAGEN_PROXY_TLS_KEY (required to listen beyond loopback), NGINX_BIN.
# The server's auth string (PREFECT_SERVER_API_AUTH_STRING, else the auth file of infra/prefect-auth.sh) is what the
# proxy sends upstream, and it is the boxes' credential (role box): Prefect's events websocket checks it inside the
# socket, where no proxy can replace it, and a worker's flow runs record their task runs through that socket.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=infra/prefect-auth.sh
. "$root/infra/prefect-auth.sh"
state=${DATAGEN_PROXY_DIR:-$root/.datagen/prefect-proxy}
listen=${DATAGEN_PROXY_LISTEN:-127.0.0.1:4300}
upstream=${DATAGEN_PROXY_UPSTREAM:-127.0.0.1:4200}

nginx_bin=${NGINX_BIN:-}
# Debian bookworm's nginx and its njs module (the proxy checks request bodies with it), pinned: the versions the
# tests ran with. A newer Debian security update of either: change these after running tests/e2e/test_security_*.
NGINX_PACKAGES=(nginx-light=1.22.1-9+deb12u9 libnginx-mod-http-js=0.7.9-2)
njs_module=${DATAGEN_NJS_MODULE:-/usr/lib/nginx/modules/ngx_http_js_module.so}
find_nginx() {
  if [ -z "$nginx_bin" ]; then nginx_bin=$(command -v nginx || true); fi
  if [ -z "$nginx_bin" ] && [ -x /usr/sbin/nginx ]; then nginx_bin=/usr/sbin/nginx; fi
  if [ -z "$nginx_bin" ] || [ ! -f "$njs_module" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "prefect-proxy.sh: installing ${NGINX_PACKAGES[*]} (Debian) ..." >&2
      if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${NGINX_PACKAGES[@]}" >&2; then
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${NGINX_PACKAGES[@]}" >&2
      fi
      [ -n "$nginx_bin" ] || nginx_bin=/usr/sbin/nginx
    else
      echo "prefect-proxy.sh: nginx with its njs module is not installed:" \
        "\`sudo apt-get install ${NGINX_PACKAGES[*]}\` (or set NGINX_BIN and DATAGEN_NJS_MODULE)" >&2
      exit 2
    fi
  fi
}

private_state() { mkdir -p "$state/tmp" "$state/credentials" && chmod 700 "$state" "$state/credentials" "$state/tmp"; }

b64() { printf '%s' "$1" | base64 -w0; }

# roles.map (what nginx reads) from users.map (what add-user writes, `"Basic <base64>" role; # name`): each
# credential as an anchored regular expression, because nginx's map compares plain strings ignoring case.
# Base64 holds letters, digits, + / =; only + needs quoting, as [+].
render_roles() {
  (umask 077 && sed -n -E 's/^"Basic ([A-Za-z0-9+\/=]+)" (operator|runner|box); # ([A-Za-z0-9._-]+)$/"~^Basic \1$" "\2 \3";/p' \
    "$state/users.map" | sed -E 's/[+]/[+]/g' > "$state/roles.map.$$" && mv "$state/roles.map.$$" "$state/roles.map")
}

upstream_auth() {
  local s=${PREFECT_SERVER_API_AUTH_STRING:-}
  if [ -z "$s" ]; then
    local file; file=$(datagen_auth_file "$root")
    if [ ! -f "$file" ]; then
      echo "prefect-proxy.sh: no PREFECT_SERVER_API_AUTH_STRING and no $file: start the server first" \
        "(infra/prefect-server.sh) or set it" >&2
      exit 2
    fi
    s=$(datagen_read_auth_file "$file" prefect-proxy.sh)
  fi
  printf '%s' "$s"
}

render() {
  local host=${listen%:*} tls="" s host_header=$listen
  host=${host#[}; host=${host%]}
  case "$host" in
    127.0.0.1|localhost|::1) ;;
    *)
      if [ -z "${DATAGEN_PROXY_TLS_CERT:-}" ] || [ -z "${DATAGEN_PROXY_TLS_KEY:-}" ]; then
        echo "prefect-proxy.sh: listening on $listen (beyond loopback) needs TLS: set DATAGEN_PROXY_TLS_CERT and" \
          "DATAGEN_PROXY_TLS_KEY (credentials travel in every request)" >&2
        exit 2
      fi ;;
  esac
  if [ -n "${DATAGEN_PROXY_TLS_CERT:-}" ]; then
    listen="$listen ssl"
    tls="ssl_certificate ${DATAGEN_PROXY_TLS_CERT}; ssl_certificate_key ${DATAGEN_PROXY_TLS_KEY}; ssl_protocols TLSv1.2 TLSv1.3;"
  fi
  private_state
  s=$(upstream_auth)
  [ -f "$state/users.map" ] || (umask 077 && : > "$state/users.map")
  chmod 600 "$state/users.map"
  # The boxes' credential is the upstream one (see the header); rewritten at every start, so rotating the
  # server's string rotates it.
  (umask 077 && grep -v ' box; # upstream$' "$state/users.map" > "$state/users.map.$$" || true
   printf '"Basic %s" box; # upstream\n' "$(b64 "$s")" >> "$state/users.map.$$"
   mv "$state/users.map.$$" "$state/users.map")
  render_roles
  (umask 077 && {
    printf 'proxy_set_header Authorization "Basic %s";\n' "$(b64 "$s")"
    printf 'proxy_set_header Host $datagen_host;\nproxy_set_header X-Forwarded-For $remote_addr;\n'
    printf 'proxy_set_header X-Forwarded-Proto $scheme;\n'
    # The server takes these as "created by an automation" (prefect/server/api/dependencies.py): never from people.
    printf 'proxy_set_header Prefect-Automation-Id "";\nproxy_set_header Prefect-Automation-Name "";\n'
  } > "$state/upstream-headers.conf")
  (umask 077 && sed -e "s#@STATE@#$state#g" -e "s#@UPSTREAM@#$upstream#g" -e "s#@LISTEN@#$listen#g" \
    -e "s#@TLS@#$tls#g" -e "s#@HOST@#$host_header#g" -e "s#@INFRA@#$root/infra#g" -e "s#@NJS_MODULE@#$njs_module#g" \
    "$root/infra/nginx/prefect-proxy.conf" > "$state/nginx.conf")
  "$nginx_bin" -t -q -p "$state" -c "$state/nginx.conf" -e "$state/error.log"
}

case "${1:-}" in
  add-user)
    name=${2:-}; role=${3:-}
    if ! [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$ ]] || { [ "$role" != operator ] && [ "$role" != runner ]; }; then
      echo "usage: $0 add-user NAME operator|runner   (NAME: letters, digits, . _ -)" >&2; exit 2
    fi
    private_state
    cred="$state/credentials/$name"
    if [ -e "$cred" ]; then echo "prefect-proxy.sh: $name exists ($cred); remove its line from users.map and the file to replace it" >&2; exit 2; fi
    token=$(head -c 33 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
    (umask 077 && printf '%s:%s\n' "$name" "$token" > "$cred"
     printf '"Basic %s" %s; # %s\n' "$(b64 "$name:$token")" "$role" "$name" >> "$state/users.map")
    chmod 600 "$state/users.map"
    render_roles
    # A running proxy reads the map at (re)load.
    if [ -s "$state/nginx.pid" ] && kill -0 "$(cat "$state/nginx.pid")" 2>/dev/null; then
      kill -HUP "$(cat "$state/nginx.pid")"
      sleep 1  # the reload takes effect once nginx has re-read its files
    fi
    echo "$name ($role): credential in $cred (give it to them through your secret store; the UI asks for it once)" ;;
  run)
    find_nginx; render
    exec "$nginx_bin" -p "$state" -c "$state/nginx.conf" -e "$state/error.log" -g "daemon off;" ;;
  start)
    find_nginx
    if [ -s "$state/nginx.pid" ] && kill -0 "$(cat "$state/nginx.pid")" 2>/dev/null; then
      echo "already running (pid $(cat "$state/nginx.pid"))"; exit 0
    fi
    render
    "$nginx_bin" -p "$state" -c "$state/nginx.conf" -e "$state/error.log"
    scheme=http; [ -n "${DATAGEN_PROXY_TLS_CERT:-}" ] && scheme=https
    echo "export PREFECT_API_URL=$scheme://${listen%% *}/api   # through the proxy" ;;
  install)
    find_nginx ;;
  stop)
    if [ -s "$state/nginx.pid" ]; then kill -QUIT "$(cat "$state/nginx.pid")" 2>/dev/null || true; fi ;;
  *) echo "usage: $0 add-user NAME operator|runner | run | start | stop | install" >&2; exit 2 ;;
esac
