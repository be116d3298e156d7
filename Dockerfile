# syntax=docker/dockerfile:1
# One static binary serves every subcommand: broker, proxy, sample-driver,
# certs, status, demo. Build: docker build -t csibroker .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/csibroker ./cmd/csibroker

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/csibroker /csibroker
USER nonroot:nonroot
ENTRYPOINT ["/csibroker"]
CMD ["broker", "--help"]
