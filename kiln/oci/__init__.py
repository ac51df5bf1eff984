"""OCI images without a daemon: references, registry transport, verified blobs, vLLM extraction.

Modules, one job each:
    reference   image references and skopeo-style locations (docker://, oci:, docker-archive:)
    mediatypes  manifest/layer media types and the manifest Accept header
    digest      sha256 helpers and the verifying stream reader
    credentials registry credentials from env vars and the Docker/Podman auth file
    auth        Www-Authenticate challenges, Bearer token cache, Basic auth
    endpoints   mirrors (docker.io=127.0.0.1:5000), Docker Hub's API host, insecure registries
    registry    RegistryClient: manifests, blobs, mounts, uploads; resumed downloads, restarted uploads
    retry       RetryPolicy (bounded backoff, Retry-After cap, KILN_REGISTRY_* env), TransferError
    manifest    Manifest bytes + Descriptor parsing, platform selection
    blobcache   content-addressed blob cache, filled only with verified bytes
    image       the Image abstraction: RemoteImage, OciLayoutImage, open_image()
    layerwalk   top-down overlay walk extracting vllm/**/*.py and dist-info metadata
    pull        ImageSource (SourceProvider) and read_vllm()
    layer, mutate, sinks   the bake and publish side (see their own docstrings)
"""
