# The stack's other servers built from Debian 12's packages, for machines that cannot pull the
# upstream images (redis, oliver006/redis_exporter, prom/prometheus). One target each:
#
#   docker build --target redis          -t tether-redis:7.0 - <deploy/docker/infra.Dockerfile
#   docker build --target redis-exporter -t tether-redis-exporter:1.45 - <deploy/docker/infra.Dockerfile
#   docker build --target prometheus     -t tether-prometheus:2.42 - <deploy/docker/infra.Dockerfile
#
# (without a registry add --build-arg BASE_IMAGE=tether-base:bookworm, from base-image.sh), then
# set REDIS_IMAGE, REDIS_EXPORTER_IMAGE and PROMETHEUS_IMAGE in deploy/compose/.env. Each
# image behaves as docker-compose.yml expects of the upstream one: same user ids (redis 999,
# exporter and Prometheus nobody), same data directories, the same tools for the health checks
# (redis-cli; wget for Prometheus). Redis is Debian's 7.0.15: Tether uses only Redis 7.0 commands.
# Grafana is not packaged by Debian; it has no target here.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS redis
# The user first, with the upstream image's ids, so the package keeps them.
RUN groupadd --system --gid 999 redis \
 && useradd --system --uid 999 --gid 999 --home-dir /var/lib/redis --no-create-home --shell /usr/sbin/nologin redis \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown 999:999 /data
WORKDIR /data
USER 999:999
EXPOSE 6379
CMD ["redis-server", "--dir", "/data", "--protected-mode", "yes"]

FROM ${BASE_IMAGE} AS redis-exporter
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus-redis-exporter \
 && rm -rf /var/lib/apt/lists/*
USER 65534:65534
EXPOSE 9121
ENTRYPOINT ["/usr/bin/prometheus-redis-exporter"]

FROM ${BASE_IMAGE} AS prometheus
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown 65534:65534 /prometheus
WORKDIR /prometheus
USER 65534:65534
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
