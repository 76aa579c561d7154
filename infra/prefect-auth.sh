# Sourced by the infra scripts: the Prefect server's auth string (basic auth, always on; docs/security.md).
# The server takes it as PREFECT_SERVER_API_AUTH_STRING, every client (CLI, deploy, worker, flow runs) as
# PREFECT_API_AUTH_STRING. Where neither is in the environment, it is read from one file (mode 0600):
# DATAGEN_PREFECT_AUTH_FILE, default <checkout>/.datagen/prefect-auth, holding "user:password" on one line.

# datagen_auth_file ROOT: the auth file's path.
datagen_auth_file() { printf '%s\n' "${DATAGEN_PREFECT_AUTH_FILE:-$1/.datagen/prefect-auth}"; }

# datagen_ensure_auth_file FILE: generate "datagen:<random>" once (0600); never replace an existing one.
datagen_ensure_auth_file() {
  local file=$1 token
  if [ ! -s "$file" ]; then
    mkdir -p "$(dirname "$file")"
    # head ends first: no SIGPIPE under pipefail. 33 random bytes -> ~44 base64 chars, ~40 kept.
    token=$(head -c 33 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
    (umask 077 && printf 'datagen:%s\n' "$token" > "$file.$$" && mv "$file.$$" "$file")
  fi
  chmod 600 "$file"
}

# datagen_read_auth_file FILE SCRIPT: the string in FILE; refuses a file others can read.
datagen_read_auth_file() {
  local file=$1 mode
  mode=$(stat -c '%a' "$file")
  if [ "${mode: -2}" != "00" ]; then
    echo "$2: $file is readable by others (mode $mode): chmod 600 it (it holds the Prefect server's auth string)" >&2
    return 2
  fi
  head -n 1 "$file" | tr -d '\r\n'
}

# datagen_client_auth ROOT SCRIPT: export PREFECT_API_AUTH_STRING for this client, or explain and fail.
datagen_client_auth() {
  local file
  [ -n "${PREFECT_API_AUTH_STRING:-}" ] && return 0
  file=$(datagen_auth_file "$1")
  if [ ! -f "$file" ]; then
    echo "$2: the Prefect server refuses clients without its auth string: export PREFECT_API_AUTH_STRING" \
      "(the server's PREFECT_SERVER_API_AUTH_STRING) or set DATAGEN_PREFECT_AUTH_FILE to a file holding it" \
      "(no $file here; docs/security.md)" >&2
    return 2
  fi
  PREFECT_API_AUTH_STRING=$(datagen_read_auth_file "$file" "$2")
  export PREFECT_API_AUTH_STRING
}
