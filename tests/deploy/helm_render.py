#!/usr/bin/python3
"""A renderer for the subset of Helm (Go text/template + sprig) that helm/geofp8 uses.

Debian 12 packages no helm binary, so CI renders the chart with this instead. It implements,
with Go's semantics, exactly what the chart's templates need and refuses everything else with an
error naming the template, so a template that grows past the subset fails the test instead of
rendering wrongly:

  actions     {{ pipeline }}, {{- and -}} whitespace trimming, {{/* comments */}}
  control     if / else if / else / end, with / else / end, define / end
  operands    .Field.Path, $.Field.Path, ".", "$", "strings", `raw`, integers, true, false, (pipeline)
  functions   include, nindent, indent, quote, toYaml, default, required, fail, not, and, or,
              eq, ne; .Files.Get "path"
  objects     .Values (values.yaml deep-merged with overrides, null deletes a key, as helm does),
              .Release.Name/.Namespace/.Service, .Chart.Name/.Version/.AppVersion, .Files.Get

Deliberate strictness beyond Helm: printing a missing value is an error (Helm prints "" or
"<no value>"), and printing an integer >= 1e6 taken from values is an error, because Helm holds
values.yaml numbers as float64 and would print 1e+06.

Usage as a program, like `helm template`:

  helm_render.py CHART [-f overrides.yaml]... [--set-json '{...}'] [--notes]

validates the merged values against CHART/values.schema.json (python3-jsonschema, Draft 7, as
helm does before rendering), then prints the manifests on stdout: one "---" and "# Source:" line
per non-empty YAML document, so the output can go to `kubectl apply -f -`. NOTES.txt is rendered
(a `fail` in it fails the render, as in helm) but not printed; --notes prints it on stderr.
Values that break the schema (a wrong type, an unknown key, a value out of range) are listed one
per line as "path: message" on stderr, and the exit status is 1, as for any render error.
"""
import copy
import json
import os
import re
import sys

import yaml


class RenderError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)


def _split(text, name):
    """Yields ("text", str) and ("action", str) pieces with trim markers applied."""
    pieces, pos = [], 0
    for m in ACTION.finditer(text):
        pieces.append(["text", text[pos:m.start()]])
        if m.group(1):
            pieces[-1][1] = pieces[-1][1].rstrip(" \t\r\n")
        body = m.group(2).strip()
        pieces.append(["action", body, bool(m.group(3))])
        pos = m.end()
    pieces.append(["text", text[pos:]])
    out = []
    trim_next = False
    for p in pieces:
        if p[0] == "text":
            t = p[1].lstrip(" \t\r\n") if trim_next else p[1]
            trim_next = False
            if t:
                out.append(("text", t))
        else:
            if "{{" in p[1]:
                raise RenderError("%s: nested '{{' in action %r" % (name, p[1]))
            out.append(("action", p[1]))
            trim_next = p[2]
    return out


TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<num>-?\d+)
  | (?P<field>(?:\$|\.)?(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\$|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[|()])
)""", re.X)


def _tokens(src, name):
    toks, pos = [], 0
    src = src.rstrip()
    while pos < len(src):
        m = TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise RenderError("%s: cannot parse %r at %r" % (name, src, src[pos:]))
        kind = m.lastgroup
        toks.append((kind, m.group(kind)))
        pos = m.end()
    return toks


def _parse_pipeline(toks, i, name, stop=None):
    """Returns (pipeline, next index); a pipeline is a list of commands, a command a list of
    operands; an operand is (kind, value) or ("pipe", pipeline)."""
    pipeline, cmd = [], []
    while i < len(toks):
        kind, val = toks[i]
        if kind == "punct" and val == ")":
            if stop != ")":
                raise RenderError("%s: unbalanced ')'" % name)
            break
        if kind == "punct" and val == "|":
            if not cmd:
                raise RenderError("%s: empty command before '|'" % name)
            pipeline.append(cmd)
            cmd = []
            i += 1
            continue
        if kind == "punct" and val == "(":
            sub, i = _parse_pipeline(toks, i + 1, name, stop=")")
            cmd.append(("pipe", sub))
            i += 1  # the ')'
            continue
        cmd.append((kind, val))
        i += 1
    if stop == ")" and (i >= len(toks) or toks[i] != ("punct", ")")):
        raise RenderError("%s: missing ')'" % name)
    if not cmd:
        raise RenderError("%s: empty pipeline" % name)
    pipeline.append(cmd)
    return pipeline, i


def _pipeline(src, name):
    toks = _tokens(src, name)
    p, i = _parse_pipeline(toks, 0, name)
    if i != len(toks):
        raise RenderError("%s: trailing tokens in %r" % (name, src))
    return p


def parse(text, name, defines):
    """Parses a template into a node list; {{ define }} blocks go into `defines`."""
    pieces = _split(text, name)
    pos = 0

    def block(ends):
        nonlocal pos
        nodes = []
        while pos < len(pieces):
            kind, body = pieces[pos]
            pos += 1
            if kind == "text":
                nodes.append(("text", body))
                continue
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise RenderError("%s: unterminated comment" % name)
                continue
            word = body.split(None, 1)[0] if body else ""
            rest = body[len(word):].strip()
            if word in ends:
                return nodes, word, rest
            if word == "if" or word == "with":
                branches, else_nodes = [], []
                cond, term = rest, None
                while True:
                    body_nodes, term, trest = block(("else", "end"))
                    branches.append((_pipeline(cond, name), body_nodes))
                    if term == "end":
                        break
                    if trest.startswith("if ") and word == "if":
                        cond = trest[3:]
                        continue
                    if trest:
                        raise RenderError("%s: unsupported 'else %s'" % (name, trest))
                    else_nodes, term, _ = block(("end",))
                    break
                nodes.append((word, branches, else_nodes))
            elif word == "define":
                tname = json.loads(rest)
                body_nodes, _, _ = block(("end",))
                defines[tname] = body_nodes
            elif word in ("range", "template", "block", "else", "end") or ":=" in body \
                    or re.match(r"\$[A-Za-z]", body):
                raise RenderError("%s: %r is outside the supported subset (see helm_render.py)"
                                  % (name, body))
            else:
                nodes.append(("out", _pipeline(body, name)))
        if ends:
            raise RenderError("%s: missing {{ end }}" % name)
        return nodes, None, None

    nodes, _, _ = block(())
    return nodes


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------

class Missing:
    """A value that is not there (Go's nil / missing map key)."""

    def __init__(self, path):
        self.path = path

    def __bool__(self):
        return False


def truthy(v):
    if isinstance(v, Missing) or v is None:
        return False
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return v != 0
    if isinstance(v, (str, list, dict)):
        return len(v) > 0
    return True


def to_text(v, where):
    if isinstance(v, Missing) or v is None:
        raise RenderError("%s: prints a missing value %s" % (where, getattr(v, "path", "nil")))
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        if abs(v) >= 1000000:
            raise RenderError("%s: prints the integer %d, which helm prints as a float (%g); "
                              "quote it in values" % (where, v, v))
        return str(v)
    if isinstance(v, float):
        return ("%g" % v) if v != int(v) or abs(v) >= 1e6 else str(int(v))
    if isinstance(v, (dict, list)):
        raise RenderError("%s: prints a map or list directly; use toYaml" % where)
    return str(v)


def to_yaml(v):
    if isinstance(v, Missing) or v is None:
        return "null"
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(n, s):
    pad = " " * n
    return "\n".join(pad + line for line in str(s).split("\n"))


class Renderer:
    def __init__(self, chart_dir, overrides=(), release="geofp8", namespace="default"):
        self.chart_dir = chart_dir
        chart = self._yaml("Chart.yaml")
        values = self._yaml("values.yaml") or {}
        for o in overrides:
            values = merge(values, o)
        self.values = values
        self.root = {
            "Values": values,
            "Release": {"Name": release, "Namespace": namespace, "Service": "Helm",
                        "IsInstall": True},
            "Chart": {"Name": chart["name"], "Version": chart["version"],
                      "AppVersion": chart.get("appVersion", "")},
            "Files": {"Get": self._file},
        }
        self.defines = {}
        self.templates = {}
        tdir = os.path.join(chart_dir, "templates")
        for f in sorted(os.listdir(tdir)):
            with open(os.path.join(tdir, f)) as fh:
                self.templates[f] = parse(fh.read(), "templates/" + f, self.defines)

    def schema_errors(self):
        """The merged values' schema violations (see schema_errors); [] without a schema."""
        path = os.path.join(self.chart_dir, "values.schema.json")
        if not os.path.isfile(path):
            return []
        with open(path) as f:
            return schema_errors(json.load(f), self.values)

    def _yaml(self, rel):
        with open(os.path.join(self.chart_dir, rel)) as f:
            return yaml.safe_load(f)

    def _file(self, rel):
        path = os.path.join(self.chart_dir, rel)
        if not os.path.isfile(path):
            raise RenderError(".Files.Get: no file %s in the chart" % rel)
        with open(path) as f:
            return f.read()

    # -- operands and functions ----------------------------------------------------------------
    def _field(self, dot, path, where):
        base = self.root if path.startswith("$") else dot
        parts = [p for p in path.lstrip("$").split(".") if p]
        v = base
        for p in parts:
            if isinstance(v, dict) and p in v:
                v = v[p]
            elif isinstance(v, dict) or isinstance(v, Missing):
                return Missing(path)
            else:
                raise RenderError("%s: cannot read .%s of a %s (%s)" %
                                  (where, p, type(v).__name__, path))
        return v

    def _operand(self, op, dot, where):
        kind, val = op
        if kind == "str":
            return json.loads(val)
        if kind == "raw":
            return val[1:-1]
        if kind == "num":
            return int(val)
        if kind == "field":
            return self._field(dot, val, where)
        if kind == "pipe":
            return self._eval(val, dot, where)
        if kind == "ident":
            if val in ("true", "false"):
                return val == "true"
            if val == "nil":
                return None
            raise RenderError("%s: function %s used as a value" % (where, val))
        raise RenderError("%s: bad operand %r" % (where, val))

    def _call(self, cmd, dot, where, piped):
        head = cmd[0]
        args_ops = cmd[1:]
        if head[0] == "field" and head[1] in (".Files.Get", "$.Files.Get"):
            args = [self._operand(a, dot, where) for a in args_ops] + piped
            if len(args) != 1:
                raise RenderError("%s: .Files.Get takes one path" % where)
            return self._file(args[0])
        if head[0] != "ident" or head[1] in ("true", "false", "nil"):
            if args_ops or piped:
                raise RenderError("%s: %r is not a function" % (where, head[1]))
            return self._operand(head, dot, where)
        fn = head[1]
        if fn in ("and", "or"):
            # Go 1.18+ short-circuits and/or.
            vals = [lambda a=a: self._operand(a, dot, where) for a in args_ops]
            vals += [lambda p=p: p for p in piped]
            last = None
            for get in vals:
                last = get()
                if (fn == "and") != truthy(last):
                    return last
            return last
        args = [self._operand(a, dot, where) for a in args_ops] + piped
        n = len(args)

        def want(k):
            if n != k:
                raise RenderError("%s: %s takes %d arguments, got %d" % (where, fn, k, n))

        if fn == "include":
            want(2)
            if args[0] not in self.defines:
                raise RenderError("%s: include of undefined template %r" % (where, args[0]))
            return self._run(self.defines[args[0]], args[1], "define " + args[0])
        if fn == "nindent":
            want(2)
            return "\n" + _indent(args[0], to_text(args[1], where))
        if fn == "indent":
            want(2)
            return _indent(args[0], to_text(args[1], where))
        if fn == "quote":
            want(1)
            return json.dumps("" if isinstance(args[0], Missing) else to_text(args[0], where))
        if fn == "toYaml":
            want(1)
            return to_yaml(args[0])
        if fn == "default":
            want(2)
            return args[1] if truthy(args[1]) else args[0]
        if fn == "required":
            want(2)
            if isinstance(args[1], Missing) or args[1] is None or args[1] == "":
                raise RenderError("execution error at (%s): %s" % (where, args[0]))
            return args[1]
        if fn == "fail":
            want(1)
            raise RenderError("execution error at (%s): %s" % (where, args[0]))
        if fn == "not":
            want(1)
            return not truthy(args[0])
        if fn in ("eq", "ne"):
            want(2)
            a, b = [None if isinstance(x, Missing) else x for x in args]
            return (a == b) == (fn == "eq")
        raise RenderError("%s: function %r is outside the supported subset" % (where, fn))

    def _eval(self, pipeline, dot, where):
        piped = []
        for cmd in pipeline:
            piped = [self._call(cmd, dot, where, piped)]
        return piped[0]

    def _run(self, nodes, dot, where):
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "out":
                out.append(to_text(self._eval(node[1], dot, where), where))
            else:  # if / with
                _, branches, else_nodes = node
                for cond, body in branches:
                    v = self._eval(cond, dot, where)
                    if truthy(v):
                        out.append(self._run(body, v if kind == "with" else dot, where))
                        break
                else:
                    out.append(self._run(else_nodes, dot, where))
        return "".join(out)

    def render(self):
        """{template file name: rendered text} for every template not starting with '_'."""
        return {name: self._run(nodes, self.root, "templates/" + name)
                for name, nodes in self.templates.items() if not name.startswith("_")}

    def documents(self, rendered=None):
        """[(template name, text)] of every non-empty YAML document in template order, split on
        "---" lines as helm splits them; documents that are empty or only comments are dropped,
        as `helm template` drops them. NOTES.txt and other non-YAML files are not documents."""
        docs = []
        for name, text in sorted((rendered or self.render()).items()):
            if not name.endswith((".yaml", ".yml")):
                continue
            for piece in re.split(r"(?m)^---[ \t]*(?:#.*)?$", text):
                try:
                    parsed = yaml.safe_load(piece)
                except yaml.YAMLError as e:
                    raise RenderError("templates/%s renders invalid YAML: %s\n%s"
                                      % (name, e, piece))
                if parsed is not None:
                    docs.append((name, piece.strip("\n")))
        return docs

    def manifests(self):
        """[(template name, document)] of every non-empty YAML document, as helm installs them."""
        docs = []
        for name, text in sorted(self.render().items()):
            if not name.endswith((".yaml", ".yml")):
                continue
            try:
                parsed = list(yaml.safe_load_all(text))
            except yaml.YAMLError as e:
                raise RenderError("templates/%s renders invalid YAML: %s\n%s" % (name, e, text))
            docs += [(name, d) for d in parsed if d is not None]
        return docs


def _value_path(path):
    """worker.env[0].name for the deque ["worker", "env", 0, "name"]; (root) for the top."""
    out = ""
    for p in path:
        out += "[%d]" % p if isinstance(p, int) else ("." if out else "") + str(p)
    return out or "(root)"


def schema_errors(schema, values):
    """["path: message"] for every way `values` breaks the JSON schema (Draft 7), sorted by path;
    an unknown key is named by its own path."""
    import jsonschema  # python3-jsonschema (scripts/lib/common.sh installs it)
    errs = []
    for e in jsonschema.Draft7Validator(schema).iter_errors(values):
        where = list(e.absolute_path)
        if e.validator == "additionalProperties" and e.validator_value is False \
                and isinstance(e.instance, dict):
            known = e.schema.get("properties", {})
            patterns = list(e.schema.get("patternProperties", {}))
            for key in sorted(e.instance):
                if key in known or any(re.search(p, key) for p in patterns):
                    continue
                errs.append((where + [key], "unknown key; %s: %s" % (
                    "%s takes" % _value_path(where) if where else "the top level takes",
                    ", ".join(sorted(known)) or "no keys")))
        else:
            errs.append((where, e.message))
    errs.sort(key=lambda pe: (_value_path(pe[0]), pe[1]))
    return ["%s: %s" % (_value_path(p), m) for p, m in errs]


def merge(base, override):
    """Helm's coalescing of user values over chart values: maps merge, null deletes."""
    out = copy.deepcopy(base)
    for k, v in (override or {}).items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    chart, overrides, notes, i = argv[0], [], False, 1
    while i < len(argv):
        if argv[i] == "--notes":
            notes = True
            i += 1
            continue
        if argv[i] == "-f" and i + 1 < len(argv):
            with open(argv[i + 1]) as f:
                overrides.append(yaml.safe_load(f) or {})
        elif argv[i] == "--set-json" and i + 1 < len(argv):
            overrides.append(json.loads(argv[i + 1]))
        else:
            print("helm_render.py: error: unknown argument %r" % argv[i], file=sys.stderr)
            return 2
        i += 2
    try:
        r = Renderer(chart, overrides)
        errs = r.schema_errors()
        if errs:
            raise RenderError("values don't meet the specifications of %s/values.schema.json:\n"
                              % os.path.basename(os.path.normpath(chart))
                              + "\n".join("- " + e for e in errs))
        rendered = r.render()
        docs = r.documents(rendered)
    except RenderError as e:
        print("helm_render.py: error: %s" % e, file=sys.stderr)
        return 1
    for name, text in docs:
        print("---\n# Source: %s/templates/%s\n%s" % (r.root["Chart"]["Name"], name, text))
    if notes and "NOTES.txt" in rendered:
        print(rendered["NOTES.txt"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
