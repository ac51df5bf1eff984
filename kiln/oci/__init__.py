"""OCI images without a daemon: references, registry transport, verified blobs, layers, mutation.

Modules, one job each:
    reference   image references and the OCI name grammar (tags)
    mediatypes  manifest/layer media types and the manifest Accept header
    digest      sha256 helpers and the verifying stream reader
    credentials registry credentials from env vars and the Docker/Podman auth file
    auth        Www-Authenticate challenges, Bearer token cache, Basic auth
    endpoints   mirrors (docker.io=127.0.0.1:5000, pulls only), Docker Hub's API host, insecure registries
    registry    RegistryClient: manifests, blobs, mounts, uploads; resumed downloads, restarted uploads
    retry       RetryPolicy (bounded backoff, Retry-After cap, KILN_REGISTRY_* env), TransferError
    manifest    Manifest bytes + Descriptor parsing, platform selection
    blobcache   content-addressed blob cache, filled only with verified bytes
    image       the Image abstraction (readers): RemoteImage, OciLayoutImage
    layer       deterministic layer tarballs
    mutate      pure steps deriving a new image (config + manifest) from a base
    blobstore   every blob a built image needs as verified local files (for the publishers)

The writers of an image (registry push, OCI layout, docker-archive, ...) are in ``kiln.publish``.
"""
