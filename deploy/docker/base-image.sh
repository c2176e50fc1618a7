#!/usr/bin/env bash
# Build a Debian 12 base image locally, for machines that cannot pull from a registry.
#
#   deploy/docker/base-image.sh [TAG]        (default TAG: tether-base:bookworm; needs root)
#
# debootstrap --variant=minbase from a Debian mirror, trimmed the way debian:bookworm-slim is
# (no apt lists or package caches, docs and man pages left out of later installs), with the
# bookworm, bookworm-updates and bookworm-security suites, then `docker import`. Use it as the
# Dockerfile's CPU_IMAGE (`--build-arg CPU_IMAGE=tether-base:bookworm`) and as the BASE_IMAGE of
# deploy/docker/infra.Dockerfile (its Redis, redis_exporter and Prometheus targets).
# Reuses an existing image of that tag; set REBUILD=1 to build it again.
set -euo pipefail
TAG="${1:-tether-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

if [ -z "${REBUILD:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists (REBUILD=1 to build it again)"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "debootstrap is missing: apt-get install -y debootstrap" >&2
  exit 1
}
[ "$(id -u)" = 0 ] || {
  echo "debootstrap needs root" >&2
  exit 1
}

root="$(mktemp -d /var/tmp/tether-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || {
  tail -20 "$root.log" >&2
  exit 1
}
rm -f "$root.log"

rm -f "$root/etc/apt/sources.list"
cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
# What debian:*-slim does: keep docs, man pages and locales out of every later install, and let
# apt clean up after itself.
cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
echo 'APT::Install-Recommends "false";' >"$root/etc/apt/apt.conf.d/docker-no-recommends"
rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*.log "$root"/tmp/*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
: >"$root/etc/machine-id"
# /var/tmp and /tmp keep their modes (1777) in the tar stream.
tar --numeric-owner -C "$root" -c . |
  docker import \
    --change 'CMD ["bash"]' \
    --change 'ENV LANG=C.UTF-8' \
    --message "debootstrap --variant=minbase bookworm ($MIRROR)" \
    - "$TAG" >/dev/null
echo "built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
