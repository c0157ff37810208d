#!/usr/bin/env python3
"""A small kustomize: renders the subset of kustomization features deploy/k8s uses, so the
manifests can be validated on machines without kubectl/kustomize.

Supported: Kustomization (kustomize.config.k8s.io/v1beta1) and Component (v1alpha1) with
`resources` (files and directories), `components`, `namespace`, `images` (name, newName, newTag,
digest) and `patches` given by `path` holding strategic-merge patches (target taken from the
patch's apiVersion/kind/metadata.name; `key: null` deletes a key). Lists merge as Kubernetes
does for the fields used here: containers, env, volumes, volumeMounts (by mountPath) and ports
(by containerPort or port), items only the patch has first, as kustomize orders them; every
other list is replaced. Anything else is an error, never
silently ignored.

  kustomize_lite.py DIR [--component DIR]...   prints the rendered YAML stream
"""
import copy
import os
import sys

try:
    import yaml
except ImportError:
    sys.exit("FAIL: PyYAML missing: apt-get install python3-yaml (or pip install PyYAML)")

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "components", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass",
                  "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
# List fields merged item by item, and the key that identifies an item.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}


class RenderError(Exception):
    pass


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def read_kustomization(directory):
    path = os.path.join(directory, "kustomization.yaml")
    if not os.path.exists(path):
        raise RenderError(f"{directory}: no kustomization.yaml")
    docs = load_yaml_docs(path)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise RenderError(f"{path}: expected one mapping")
    k = docs[0]
    unknown = set(k) - KUSTOMIZATION_FIELDS
    if unknown:
        raise RenderError(f"{path}: unsupported fields {sorted(unknown)}")
    expected = {"Kustomization": "kustomize.config.k8s.io/v1beta1",
                "Component": "kustomize.config.k8s.io/v1alpha1"}
    if expected.get(k.get("kind")) != k.get("apiVersion"):
        raise RenderError(f"{path}: kind/apiVersion must be Kustomization/{expected['Kustomization']} "
                          f"or Component/{expected['Component']}")
    return path, k


def key_of(obj):
    group = obj["apiVersion"].rsplit("/", 1)[0] if "/" in obj["apiVersion"] else ""
    return (group, obj["kind"], obj["metadata"]["name"])


def strategic_merge(base, patch, where):
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if k.startswith("$"):
            raise RenderError(f"{where}: patch directive {k} not supported")
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = strategic_merge(out[k], v, f"{where}.{k}")
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = merge_list(k, out[k], v, f"{where}.{k}")
        else:
            out[k] = copy.deepcopy(v)
    return out


def merge_list(field, base, patch, where):
    key = MERGE_KEYS.get(field)
    if field == "ports":
        key = "containerPort" if any("containerPort" in p for p in base + patch) else "port"
    if key is None:
        return copy.deepcopy(patch)
    out, new = copy.deepcopy(base), []
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise RenderError(f"{where}: list item without merge key {key}")
        for i, existing in enumerate(out):
            if existing.get(key) == item[key]:
                out[i] = strategic_merge(existing, item, f"{where}[{item[key]}]")
                break
        else:
            new.append(copy.deepcopy(item))
    return new + out  # kustomize puts items only the patch has first


def apply_patches(objs, k, kpath, directory):
    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise RenderError(f"{kpath}: only `patches: - path: FILE` is supported, got {entry}")
        ppath = os.path.join(directory, entry["path"])
        for patch in load_yaml_docs(ppath):
            target = key_of(patch)
            hits = [i for i, o in enumerate(objs) if key_of(o) == target]
            if len(hits) != 1:
                raise RenderError(f"{ppath}: patch target {target} matches {len(hits)} resources")
            i = hits[0]
            objs[i] = strategic_merge(objs[i], patch, f"{ppath}:{target[1]}/{target[2]}")


def pod_specs(obj):
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        yield spec
    elif isinstance(spec.get("template"), dict):
        yield spec["template"].get("spec", {})
    elif obj["kind"] == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]


def split_image(image):
    digest = None
    if "@" in image:
        image, digest = image.split("@", 1)
    tag = None
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        image, tag = image[:colon], image[colon + 1:]
    return image, tag, digest


def apply_images(objs, images, kpath):
    for entry in images:
        unknown = set(entry) - {"name", "newName", "newTag", "digest"}
        if unknown or "name" not in entry:
            raise RenderError(f"{kpath}: unsupported images entry {entry}")
        for obj in objs:
            for spec in pod_specs(obj):
                for c in spec.get("containers", []) + spec.get("initContainers", []):
                    name, tag, digest = split_image(c["image"])
                    if name != entry["name"]:
                        continue
                    name = entry.get("newName", name)
                    if "newTag" in entry:
                        tag = str(entry["newTag"])
                    if "digest" in entry:
                        digest, tag = entry["digest"], None
                    c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def render(directory, extra_components=()):
    """Returns the list of objects kustomize would build from `directory`."""
    directory = os.path.abspath(directory)
    kpath, k = read_kustomization(directory)
    objs = []
    for res in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, res))
        if os.path.isdir(path):
            sub_kpath, sub = read_kustomization(path)
            if sub["kind"] != "Kustomization":
                raise RenderError(f"{kpath}: resource {res} is a Component; list it under components")
            objs.extend(render(path))
        else:
            objs.extend(load_yaml_docs(path))
    for comp in list(k.get("components", [])) + list(extra_components):
        cdir = os.path.normpath(os.path.join(directory, comp))
        ckpath, ck = read_kustomization(cdir)
        if ck["kind"] != "Component":
            raise RenderError(f"{ckpath}: not a Component")
        for res in ck.get("resources", []):
            objs.extend(load_yaml_docs(os.path.join(cdir, res)))
        apply_patches(objs, ck, ckpath, cdir)
        if "images" in ck:
            apply_images(objs, ck["images"], ckpath)
        if "namespace" in ck:
            raise RenderError(f"{ckpath}: namespace in a Component is not supported")
    seen = set()
    for o in objs:
        if key_of(o) in seen:
            raise RenderError(f"{kpath}: duplicate resource {key_of(o)}")
        seen.add(key_of(o))
    apply_patches(objs, k, kpath, directory)
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
            elif o["kind"] == "Namespace":
                o["metadata"]["name"] = k["namespace"]
    if "images" in k:
        apply_images(objs, k["images"], kpath)
    return objs


def main(argv):
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    directory, comps, rest = argv[0], [], argv[1:]
    while rest:
        if rest[0] != "--component" or len(rest) < 2:
            sys.exit(__doc__)
        comps.append(os.path.relpath(rest[1], directory))
        rest = rest[2:]
    try:
        objs = render(directory, comps)
    except (RenderError, OSError, yaml.YAMLError, KeyError) as e:
        sys.exit(f"kustomize_lite: {e}")
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))


if __name__ == "__main__":
    main(sys.argv[1:])
