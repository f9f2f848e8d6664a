"""Chat answers in the shapes models write them (a how-to with numbered steps and code between them, a
comparison table, nested pros and cons, a quoted note and a rule, a shell session, a loose list with
explanations, a table inside a paragraph): the chat page's markdown corpus (tests/test_webui.py), each with the outline its
rendering must have: top-level blocks in order; ("code", language, text), ("table", header, rows,
alignments), (list tag, start, items as (text, nested lists...)), (tag, text)."""

HOW_TO = """### Reading a GGUF file's metadata

You can use the `gguf` package that ships with **llama.cpp**:

1. Install it:

```bash
pip install gguf
```

2. Open the file and list its keys:

```python
from gguf import GGUFReader

reader = GGUFReader("model.gguf")
for name, field in reader.fields.items():
    print(name, field.types)
```

3. Look for `general.architecture` and `*.context_length`.

That's it!"""

TABLE = """Here is how the two compare:

| Feature | llama.cpp | moepass |
|:--------|:---------:|--------:|
| Format | GGUF | ONNX |
| Experts on the GPU | `-ot` regex | `partition --vram` |
| Pipes | `a \\| b` | none |

Both read the same files."""

NESTED = """- **Pros**:
  - fast decode
  - small files
- **Cons**:
  - no GPU kernels for IQ1
* Verdict: *use both*"""

QUOTE = """> **Note:** the context length is fixed at conversion.
> Convert again with `--context 8192` for more.

---

Done."""

SHELL = """#### Steps
Run these, in order (see [the docs](https://github.com/ggml-org/llama.cpp)):

1) build
2) quantize

```sh
$ cmake -B build && cmake --build build -j
$ ./build/bin/llama-quantize in.gguf out.gguf Q4_K_M
```

a | b
--- | ---
1 | 2"""

LOOSE = """1. First, convert the model.

   This writes an ONNX folder.

2. Then run it.

   Greedy decoding is the default at temperature 0.
3. Finally, serve it."""

TIGHT = """The flags:
| flag | meaning |
|------|---------|
| `-c` | context |
| `-n` | tokens  |
That is all.
a | b
---"""

CORPUS = [
    (HOW_TO, [
        ("h5", "Reading a GGUF file's metadata"),
        ("p", "You can use the gguf package that ships with llama.cpp:"),
        ("ol", None, [("Install it:",)]),
        ("code", "bash", "pip install gguf"),
        ("ol", "2", [("Open the file and list its keys:",)]),
        ("code", "python", 'from gguf import GGUFReader\n\nreader = GGUFReader("model.gguf")\n'
                           'for name, field in reader.fields.items():\n    print(name, field.types)'),
        ("ol", "3", [("Look for general.architecture and *.context_length.",)]),
        ("p", "That's it!"),
    ]),
    (TABLE, [
        ("p", "Here is how the two compare:"),
        ("table", ["Feature", "llama.cpp", "moepass"],
         [["Format", "GGUF", "ONNX"], ["Experts on the GPU", "-ot regex", "partition --vram"], ["Pipes", "a | b", "none"]],
         ["left", "center", "right"]),
        ("p", "Both read the same files."),
    ]),
    (NESTED, [
        ("ul", None, [("Pros:", ("ul", None, [("fast decode",), ("small files",)])),
                      ("Cons:", ("ul", None, [("no GPU kernels for IQ1",)])),
                      ("Verdict: use both",)]),
    ]),
    (QUOTE, [
        ("blockquote", "Note: the context length is fixed at conversion.\nConvert again with --context 8192 for more."),
        ("hr", ""),
        ("p", "Done."),
    ]),
    (SHELL, [
        ("h6", "Steps"),
        ("p", "Run these, in order (see the docs):"),
        ("ol", None, [("build",), ("quantize",)]),
        ("code", "sh", "$ cmake -B build && cmake --build build -j\n$ ./build/bin/llama-quantize in.gguf out.gguf Q4_K_M"),
        ("table", ["a", "b"], [["1", "2"]], ["", ""]),
    ]),
    (TIGHT, [
        ("p", "The flags:"),
        ("table", ["flag", "meaning"], [["-c", "context"], ["-n", "tokens"]], ["", ""]),
        ("p", "That is all.\na | b"),
        ("hr", ""),
    ]),
    (LOOSE, [
        ("ol", None, [("First, convert the model.\nThis writes an ONNX folder.",),
                      ("Then run it.\nGreedy decoding is the default at temperature 0.",),
                      ("Finally, serve it.",)]),
    ]),
]
