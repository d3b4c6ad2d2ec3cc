"""The origin's KB manifest registry: versions committed, listed, retired, quarantined (one job
of kdn/origin/store.py's ChunkStore, beside its chunks and its collector).

A KB version's manifest (manifests/<ns hex>/<name>/<version:010d>.kdnm) is written last and
only once every chunk it lists is stored, so a version is visible exactly when it is complete;
a crashed publish leaves only unreferenced chunks, which the collector removes. The manifest is
written with the backend's create-if-absent (a hard link; a PUT with If-None-Match: *), so
two publishers, even two origin processes over one bucket, never both commit one version:
the loser of an explicit number gets ManifestError, an automatic number takes the next.
commit() refuses a manifest whose checksums are not those of the stored chunks (a key means
the bytes stored first: kdn/origin/chunks.py).

Version numbers are never reused (an edge that cached v3 must never see a different v3):
retiring a version sets its manifest aside as .retired, a manifest that fails its checksum is
set aside as .corrupt (quarantined: reported, never served, the KB's other versions and every
other KB still are), and each KB keeps the highest number it ever committed in an object
`last_version`, so even a deleted manifest's number stays taken. (On disk "set aside" is a
rename; in a bucket it is a copy that leaves the .kdnm in place, so its name stays taken for
the conditional write: a version is visible while its .kdnm exists and no .retired or
.corrupt of the same number does.) Retiring a version retires its emphasized copies with it
(kdn.core.emphasis: edits of that version stored under a namespace of their own). The store's
lock serialises commits and retirements.
"""
from __future__ import annotations

import collections
import logging
import re

from kdn.core.emphasis import copies_of, is_emphasized
from kdn.core.errors import ManifestError, VersionNotFound
from kdn.core.manifest import Manifest, check_name
from kdn.origin.chunks import chunk_name, ns_digest
from kdn.origin.objects import CORRUPT_SUFFIX

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".kdnm"
RETIRED_SUFFIX = ".retired"
LAST_VERSION = "last_version"     # per KB: the highest version number ever committed
COMMIT_TRIES = 8                  # automatic numbers tried when other publishers take them first
_VERSION_NAME = re.compile(r"(\d{10})\.(kdnm|retired|corrupt)")
_MANIFEST_NAME = re.compile(r"manifests/([0-9a-f]{32})/([^/]+)/(\d{10})\.(kdnm|retired|corrupt)")


def _visible(names) -> list:
    """Committed version numbers among a KB's object names: a .kdnm with no .retired or
    .corrupt of the same number, ascending."""
    found = collections.defaultdict(set)
    for n in names:
        m = _VERSION_NAME.fullmatch(n)
        if m:
            found[m.group(2)].add(int(m.group(1)))
    return sorted(found["kdnm"] - found["retired"] - found["corrupt"])


class Registry:
    """KB manifests in `chunks`' backend (its lock and counters shared)."""

    objects = property(lambda self: self.chunks.objects)    # the chunks' backend, always

    def __init__(self, chunks):
        self.chunks = chunks
        self._lock, self.counters = chunks._lock, chunks.counters
        self._ns_names = {}          # ns hex -> (tenant, fingerprint) it digests (stats, kbs)
        chunks.committed_sums = self.committed_sums

    def committed_sums(self, key: bytes) -> set:
        """The checksums committed versions record for key (what a corrupt copy may be repaired with)."""
        return {m.sum_of().get(key) for m in self.manifests()} - {None}

    def versions_and_copies(self) -> tuple:
        """(the KBs' committed versions, the emphasized copies of them): counted apart."""
        versions = copies = 0
        for _, fp, _, visible in self._listing():
            if fp is not None and is_emphasized(fp):
                copies += len(visible)
            else:
                versions += len(visible)
        return versions, copies

    def _kb_prefix(self, ns: bytes, name: str) -> str:
        return f"manifests/{ns_digest(ns).hex()}/{check_name(name, 'KB name')}/"

    def _kb_names(self, prefix: str) -> list:
        """The names (last path part) of a KB's objects."""
        return [n[len(prefix):] for n, _ in self.objects.list(prefix)]

    def _versions(self, prefix: str) -> list:
        """Committed (not retired, not quarantined) version numbers of a KB, ascending."""
        return _visible(self._kb_names(prefix))

    def _last_used(self, prefix: str) -> int:
        """The highest version number the KB ever took (0 for none): committed, retired,
        quarantined, or recorded in its last_version object though its manifest is gone."""
        files = [int(m.group(1)) for m in map(_VERSION_NAME.fullmatch, self._kb_names(prefix)) if m]
        try:
            recorded = int(self.objects.get(prefix + LAST_VERSION))
        except FileNotFoundError:
            recorded = 0
        except (ValueError, OSError) as e:   # the manifests present still name the numbers used
            log.warning("%s is unreadable (%s); versions are numbered from the manifests present",
                        self.objects.where(prefix + LAST_VERSION), e)
            recorded = 0
        return max([recorded, *files])

    def commit(self, manifest: Manifest) -> Manifest:
        """Make a KB version visible once all its chunks are stored; return it with its version."""
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"commit() takes a Manifest, got {type(manifest).__name__}")
        manifest.check_names()            # a new version's names; stored ones are read as they are
        prefix = self._kb_prefix(manifest.ns, manifest.name)
        self._check_sums(manifest)
        with self._lock:
            keys = list(dict.fromkeys(manifest.keys))
            sizes = self.chunks.map(lambda k: self.objects.size(chunk_name(k)), keys)
            missing = [k for k, n in zip(keys, sizes) if n is None]
            if missing:
                shown = ", ".join(k.hex() for k in missing[:3])
                raise ManifestError(
                    f"cannot commit {manifest.label()}: {len(missing)} of {len(manifest.keys)} chunk(s) "
                    f"are not stored (first: {shown})")
            auto = manifest.version is None
            for _ in range(COMMIT_TRIES):
                last = self._last_used(prefix)
                if auto:
                    manifest = manifest.with_version(last + 1)
                elif manifest.version <= last:
                    raise ManifestError(f"cannot commit {manifest.label()}: version {manifest.version} "
                                        f"already exists or was used before (last: {last}); versions "
                                        f"are never reused")
                name = f"{prefix}{manifest.version:010d}{MANIFEST_SUFFIX}"
                if self.objects.put_new(name, manifest.to_bytes()):
                    break
                self.counters["commit_conflicts"] += 1    # another publisher took this number
                if not auto:
                    raise ManifestError(f"cannot commit {manifest.label()}: another publisher "
                                        f"committed version {manifest.version} first")
            else:
                raise ManifestError(f"cannot commit {manifest.label()}: other publishers took "
                                    f"{COMMIT_TRIES} version numbers in a row; try again")
            # Recorded after the manifest: until then the manifest itself holds the number.
            self.objects.put(prefix + LAST_VERSION, str(manifest.version).encode())
            self.chunks.committed(manifest.keys)
            return manifest

    def _check_sums(self, manifest: Manifest) -> None:
        """ManifestError unless every checksum the manifest records is that of the chunk
        stored under its key (a key means one byte string: readers verify against these).
        Runs outside the store's lock: its reads run in the I/O threads, which take it."""
        want = manifest.sum_of()
        if not want:
            return
        keys = list(want)
        for k, got in zip(keys, self.chunks.map(lambda k: self.chunks.sum_of(k, fresh=False), keys)):
            if got is not None and got != want[k]:   # absent: the commit's own check names it
                self.counters["sums_refused"] += 1
                raise ManifestError(
                    f"cannot commit {manifest.label()}: chunk {k.hex()} is stored with checksum "
                    f"{got:016x} but the manifest says {want[k]:016x}; a key means the bytes "
                    f"stored first, so the manifest must carry their checksum (kdn.client.publish adopts it)")

    def _load(self, name: str, ns: bytes, kb: str, version: int) -> Manifest:
        """The manifest in object `name`; one that fails its checksum or holds another version
        is quarantined (set aside as .corrupt, counted, logged) and raises ManifestError."""
        try:
            m = Manifest.from_bytes(self.objects.get(name))
            if (m.ns, m.name, m.version) != (ns, kb, version):
                raise ManifestError(f"it holds {m.label()} (ns {m.ns.hex()}), not {kb}@v{version} "
                                    f"of ns {ns.hex()}")
        except ManifestError as e:
            aside = self._quarantine(name, e)
            raise ManifestError(f"manifest file {self.objects.where(name)} is unreadable: {e}; "
                                f"moved to {aside.rsplit('/', 1)[-1]}") from None
        return m

    def _quarantine(self, name: str, why) -> str:
        aside = name[:-len(MANIFEST_SUFFIX)] + CORRUPT_SUFFIX
        with self._lock:
            if not self.objects.set_aside(name, aside):   # another reader quarantined it first
                return aside
            self.counters["manifests_quarantined"] += 1
        log.error("quarantined corrupt manifest %s as %s: %s", self.objects.where(name),
                  aside.rsplit("/", 1)[-1], why)
        return aside

    def manifest(self, ns: bytes, name: str, version: "int | None" = None) -> Manifest:
        """A committed version (the latest intact one when version is None); VersionNotFound
        if none. A corrupt manifest is quarantined: asked for by number it raises
        ManifestError naming the file, and it is no longer the latest."""
        prefix = self._kb_prefix(ns, name)
        while True:
            versions = self._versions(prefix)
            if version is not None and version not in versions:
                have = ", ".join(map(str, versions)) or "none"
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version "
                                      f"{version!r} (committed: {have})")
            if not versions:
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version")
            if version is not None:
                return self._load(f"{prefix}{version:010d}{MANIFEST_SUFFIX}", bytes(ns), name, version)
            try:
                return self._load(f"{prefix}{versions[-1]:010d}{MANIFEST_SUFFIX}", bytes(ns), name,
                                  versions[-1])
            except (ManifestError, FileNotFoundError):
                continue    # quarantined (or retired meanwhile): the latest intact one is next

    def _manifest_objects(self, ns: "bytes | None" = None) -> dict:
        """{(ns hex, name): [object names]} of every KB's version objects."""
        prefix = "manifests/" + ("" if ns is None else ns_digest(ns).hex() + "/")
        kbs = collections.defaultdict(list)
        for obj, _ in self.objects.list(prefix):
            m = _MANIFEST_NAME.fullmatch(obj)
            if m:
                kbs[m.group(1), m.group(2)].append(obj.rsplit("/", 1)[-1])
        return kbs

    def manifests(self, ns: "bytes | None" = None, name: "str | None" = None) -> list:
        """Every committed (not retired) version, of one namespace or of all (and of the KBs
        called `name` only, when given), in (ns, name, version) order; emphasized copies
        included (kdn.core.emphasis.own_manifests leaves them out). A corrupt manifest is
        quarantined and left out: the rest are served."""
        out = []
        for (ns_hex, kb), names in sorted(self._manifest_objects(ns).items()):
            if name is not None and kb != name:
                continue
            for v in _visible(names):
                try:
                    out.append(self._load(f"manifests/{ns_hex}/{kb}/{v:010d}{MANIFEST_SUFFIX}",
                                          bytes.fromhex(ns_hex), kb, v))
                except (ManifestError, FileNotFoundError):
                    continue   # quarantined and logged by _load (or retired meanwhile)
        return out

    def quarantined(self) -> list:
        """Quarantined (corrupt) manifests, as ns/name/version.corrupt."""
        return sorted(f"{ns_hex}/{kb}/{n}" for (ns_hex, kb), names in self._manifest_objects().items()
                      for n in names if n.endswith(CORRUPT_SUFFIX))

    def delete_version(self, ns: bytes, name: str, version: int) -> list:
        """Retire a version: no longer visible, its number never reused, its chunks collectable;
        and with it every emphasized copy of it (kdn.core.emphasis.copies_of: an edit of that
        version stored under its own namespace), retired first, so an interrupted retirement
        leaves the version with fewer copies, never a copy without its version. The copies
        retired, as Manifests. A copy's own version is retired like any version."""
        prefix = self._kb_prefix(ns, name)
        with self._lock:
            if version not in self._versions(prefix):
                raise VersionNotFound(f"KB {name!r} of ns {bytes(ns).hex()} has no committed version "
                                      f"{version!r} to delete")
            name_of = f"{prefix}{version:010d}{MANIFEST_SUFFIX}"
            kb = self._load(name_of, bytes(ns), name, version)
            copies = copies_of(self.manifests(name=name), kb)
            for c in copies:
                at = f"{self._kb_prefix(c.ns, c.name)}{c.version:010d}"
                self.objects.set_aside(at + MANIFEST_SUFFIX, at + RETIRED_SUFFIX)
            self.objects.set_aside(name_of, f"{prefix}{version:010d}{RETIRED_SUFFIX}")
            return copies

    def _namespace(self, ns_hex: str, kb: str, version: int) -> "tuple | None":
        """(tenant, fingerprint) a namespace digests, from one of its manifests, read once (a
        digest names one pair forever); None when that manifest is unreadable (quarantined or
        retired meanwhile: asked again next time)."""
        known = self._ns_names.get(ns_hex)
        if known is None:
            try:
                m = self._load(f"manifests/{ns_hex}/{kb}/{version:010d}{MANIFEST_SUFFIX}",
                               bytes.fromhex(ns_hex), kb, version)
            except (ManifestError, FileNotFoundError):
                return None
            known = self._ns_names[ns_hex] = (m.tenant, m.fingerprint)
        return known

    def _listing(self) -> list:
        """[(tenant, fingerprint, name, [visible versions])] of every KB and emphasized copy
        with a visible version (tenant and fingerprint None where no manifest could be read)."""
        out = []
        for (ns_hex, kb), names in sorted(self._manifest_objects().items()):
            visible = _visible(names)
            if visible:
                out.append((*(self._namespace(ns_hex, kb, visible[-1]) or (None, None)), kb, visible))
        return out

    def kbs(self) -> list:
        """The KBs' committed versions, emphasized copies left out (kdn.core.emphasis):
        [{"tenant", "name", "fingerprint", "versions"}] sorted by tenant, name, fingerprint;
        from object names, each namespace's manifest read once."""
        return sorted(({"tenant": t, "name": kb, "fingerprint": fp, "versions": vs}
                       for t, fp, kb, vs in self._listing() if fp is not None and not is_emphasized(fp)),
                      key=lambda d: (d["tenant"], d["name"], d["fingerprint"]))
