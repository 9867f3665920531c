"""dcgmi diag parsers: every real output in fixtures/tools/dcgmi/, the DCGM 3.x and 4.x JSON shapes (4.x documents
are built here from DCGM's dcgmi/Diag.cpp and checked against DCGM's own 4.0 schema: no real 4.x output is in
../shared/data), the text table, and hypothesis fuzzing (nothing but ParseError escapes)."""
import json
from pathlib import Path

import pytest
from conftest import ROOT
from deadline import MIB, deadline
from gpuwarden.agent.cli.analyze import analyze_file
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.checks.parse_dcgmi_diag import (
    DiagError,
    diag_from_json,
    looks_like_dcgmi_diag_json,
    parse_dcgmi_diag_json,
)
from gpuwarden.checks.parse_dcgmi_diag_text import looks_like_dcgmi_diag_text, parse_dcgmi_diag_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DCGMI = ROOT / "fixtures" / "tools" / "dcgmi"
SCHEMA_3 = DCGMI / "dcgm__dcgm_diag_schema__DCGM-3.3.1.json"
SCHEMA_4 = DCGMI / "dcgm__dcgm_diag_schema__DCGM-4.0.json"
R2_PASS_T4 = DCGMI / "virtualclient__dcgmi-diag-r2-j__DCGM-3.x-schema__1xT4__pass.json"
MALFORMED = DCGMI / "virtualclient__dcgmi-diag-j__MALFORMED-missing-test_categories.json"
EMPTY_CATEGORIES = DCGMI / "handmade__dcgmi-diag-j__DCGM-3.x-schema__EDITED-empty-test_categories.json"
R1_PASS_T4 = DCGMI / "virtualclient__dcgmi-diag-r1-j__DCGM-3.x-schema__1xT4__pass.json"
FRAG_MEMORY = DCGMI / "stas00__dcgmi-diag-r2__text__FRAGMENT__gpu-memory-fail-gpu0-thermal-warning.txt"
FRAG_REMAP = DCGMI / "stas00__dcgmi-diag-r3__text__FRAGMENT__deployment-error-row-remap-pending.txt"

# ------------------------------------------------------------------------------------ document builders
V3_DEPLOYMENT = ("Denylist", "NVML Library", "CUDA Main Library", "Permissions and OS Blocks", "Persistence Mode",
                 "Environment Variables", "Page Retirement/Row Remap", "Graphics Processes", "Inforom")
V3_PER_GPU = (("Integration", "PCIe"), ("Hardware", "GPU Memory"))
V4_TESTS = (("Deployment", "software"), ("Integration", "pcie"), ("Hardware", "memory"))


def warning(msg, error_id=None, category=None, severity=None, key="warning"):
    entry = {key: msg}
    for name, value in (("error_id", error_id), ("error_category", category), ("error_severity", severity)):
        if value is not None:
            entry[name] = value
    return entry


def v3_doc(n_gpus, per_gpu=None, deployment=None, tests=V3_PER_GPU, version="3.3.5"):
    """A DCGM 3.x `dcgmi diag -j` document as Diag.cpp (3.3) writes it. per_gpu: {(test, gpu): result fields},
    deployment: {test: result fields}; everything else passes."""
    per_gpu, deployment = per_gpu or {}, deployment or {}
    cats = [{"category": "Deployment", "tests": [
        {"name": t, "results": [{"status": "Pass", **deployment.get(t, {})}]} for t in V3_DEPLOYMENT]}]
    for category in dict.fromkeys(c for c, _ in tests):
        cats.append({"category": category, "tests": [
            {"name": t, "results": [{"gpu_id": str(g), "status": "Pass", **per_gpu.get((t, g), {})}
                                    for g in range(n_gpus)]} for c, t in tests if c == category]})
    return {"DCGM GPU Diagnostic": {"test_categories": cats}, "Driver Version Detected": "550.90.07",
            "GPU Device IDs": ["2330"] * n_gpus, "GPU Device Serials": {str(g): f"165232400{g}" for g in range(n_gpus)},
            "version": version}


def v4_doc(n_gpus, per_gpu=None, tests=V4_TESTS, version="4.2.3"):
    """A DCGM 4.x document as Diag.cpp (4.x) writes it: results per entity, a test_summary repeating every
    error (includeAllErrors), entity_groups and metadata. A warning prints as "Fail" in 4.x JSON."""
    per_gpu = per_gpu or {}
    rank = {"Pass": 0, "Skip": 1, "Fail": 2}
    cats = []
    for category in dict.fromkeys(c for c, _ in tests):
        entries = []
        for c, name in tests:
            if c != category:
                continue
            results = [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": g, "status": "Pass",
                        **per_gpu.get((name, g), {})} for g in range(n_gpus)]
            summary = {"status": max((r["status"] for r in results), key=rank.get, default="Pass")}
            if any("warnings" in r for r in results):
                summary["warnings"] = [w for r in results for w in r.get("warnings", ())]
            entries.append({"name": name, "results": results, "test_summary": summary})
        cats.append({"category": category, "tests": entries})
    return {"DCGM Diagnostic": {"test_categories": cats},
            "entity_groups": [{"entity_group": "GPU", "entity_group_id": 1, "entities": [
                {"entity_id": g, "device_id": "2335", "serial_num": f"165232400{g}"} for g in range(n_gpus)]}],
            "metadata": {"Driver Version Detected": "570.124.06", "version": version}}


def row(name, info):
    return f"| {name:<25} | {info:<46} |"


def message_rows(name, msg):
    """DisplayVerboseInfo in Diag.cpp: 45 characters a row, the name on the first only."""
    return [row(name if i == 0 else "", msg[i:i + 45]) for i in range(0, len(msg), 45)]


HEADER = ["Successfully ran diagnostic for group.",
          "+---------------------------+------------------------------------------------+",
          "| Diagnostic                | Result                                         |",
          "+===========================+================================================+"]
FOOTER = ["+---------------------------+------------------------------------------------+"]


def band(name, edge="+"):
    return f"{edge}-----  {name}  {'-' * (19 - len(name))}+{'-' * 48}{edge}"


# ------------------------------------------------------------------------------------ real files

# Every file in fixtures/tools/dcgmi/ (a new one must be added here): what parsing it gives.
EXPECTED = {
    "dcgm__dcgm_diag_schema__DCGM-3.3.1.json": ParseError,  # a JSON-Schema, not an output
    "dcgm__dcgm_diag_schema__DCGM-4.0.json": ParseError,
    "virtualclient__dcgmi-health-c-j__healthy.json": ParseError,  # dcgmi health, not diag
    "virtualclient__dcgmi-diag-j__MALFORMED-missing-test_categories.json": ParseError,
    "handmade__dcgmi-diag-j__DCGM-3.x-schema__EDITED-empty-test_categories.json": {},  # well formed: no test in it
    "virtualclient__dcgmi-diag-r1-j__DCGM-3.x-schema__1xT4__pass.json": {"pass": 9},
    "virtualclient__dcgmi-diag-r2-j__DCGM-3.x-schema__1xT4__pass.json": {"pass": 11},
    "virtualclient__dcgmi-diag-r3-j__DCGM-3.x-schema__1xT4__pass-with-skip.json": {"pass": 15, "skip": 1},
    "stas00__dcgmi-diag-r2__text__FRAGMENT__gpu-memory-fail-gpu0-thermal-warning.txt": {"pass": 7, "fail": 1},
    "stas00__dcgmi-diag-r3__text__FRAGMENT__deployment-error-row-remap-pending.txt": {"fail": 1},
}


def parse_file(path: Path):
    parse = parse_dcgmi_diag_text if path.suffix == ".txt" else parse_dcgmi_diag_json
    return parse(path.read_text(), path.name)


def outputs():
    return sorted(p for p in DCGMI.iterdir() if not p.name.endswith(".source.txt"))


def test_every_file_has_its_source_and_an_expectation():
    assert {p.name for p in outputs()} == set(EXPECTED)
    for path in outputs():
        assert path.with_name(path.name + ".source.txt").is_file(), path.name
        shared = ROOT.parent / "shared" / "data" / "dcgmi_diag" / path.name
        if shared.exists():
            assert shared.read_bytes() == path.read_bytes(), f"{path.name} differs from ../shared/data"


@pytest.mark.parametrize("path", outputs(), ids=lambda p: p.name)
def test_every_real_file_parses_as_expected(path):
    want = EXPECTED[path.name]
    if want is ParseError:
        with pytest.raises(ParseError):
            parse_file(path)
        return
    run = parse_file(path)
    counts = {}
    for r in run.results:
        counts[r.status] = counts.get(r.status, 0) + 1
    assert counts == want
    assert run.runtime_error is None


def test_t4_level2_pass_json():
    run = parse_file(R2_PASS_T4)
    assert run.schema == "dcgm-3.x-json" and run.version is None  # VirtualClient trimmed the metadata
    by_test = {(r.test, r.gpu): r for r in run.results}
    assert by_test[("PCIe", 0)].info[0].startswith("GPU 0 GPU 0 GPU to Host bandwidth:\t\t13.15 GB/s")
    assert by_test[("GPU Memory", 0)].category == "Hardware"
    assert by_test[("Persistence Mode", None)].category == "Deployment"  # system-wide
    assert run.gpus_listed == ()


def test_malformed_file_names_the_missing_level():
    with pytest.raises(ParseError) as err:
        parse_file(MALFORMED)
    assert "test_categories" in str(err.value) and "'DCGM GPU Diagnostic' is a list" in str(err.value)
    assert err.value.source == MALFORMED.name


def test_fragment_gpu_memory_fail_joins_the_wrapped_warning():
    run = parse_file(FRAG_MEMORY)
    failed = [r for r in run.results if r.status == "fail"]
    assert [(r.test, r.gpu) for r in failed] == [("GPU Memory", 0)]
    assert failed[0].messages == ("GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds into the "
                                  "test for GPU 0 Verify that the cooling on this machine is functional, including "
                                  "external, thermal material interface, fans, and any other components.",)
    assert sorted(r.gpu for r in run.results if r.status == "pass") == [1, 2, 3, 4, 5, 6, 7]
    assert all(not r.errors for r in run.results if r.status == "pass")


def test_fragment_deployment_error_names_gpu_3():
    (r,) = parse_file(FRAG_REMAP).results
    assert (r.category, r.test, r.gpu, r.status) == ("Deployment", "", None, "fail")
    assert r.messages == ("GPU 3 has uncorrectable memory errors and row remappings are pending",)
    assert r.gpu_ids == (3,)


def test_a_run_with_no_test_parses_to_no_result_and_says_how_many_tests_it_listed():
    empty = parse_file(EMPTY_CATEGORIES)  # DCGM's own 3.x schema allows an empty test_categories
    assert (empty.results, empty.tests, empty.runtime_error, empty.schema) == ((), 0, None, "dcgm-3.x-json")
    validate(json.loads(EMPTY_CATEGORIES.read_text())["DCGM GPU Diagnostic"],
             json.loads(SCHEMA_3.read_text())["properties"]["DCGM GPU Diagnostic"])
    doc = v3_doc(2)
    for cat in doc["DCGM GPU Diagnostic"]["test_categories"]:
        for test in cat["tests"]:
            test["results"] = []
    none = diag_from_json(doc, "x")
    assert (none.results, none.tests) == ((), len(V3_DEPLOYMENT) + len(V3_PER_GPU))
    assert parse_file(R1_PASS_T4).tests == 9
    text = parse_dcgmi_diag_text("\n".join([row("DCGM Version", "3.3.5"), row("Driver Version Detected", "550")]), "t")
    assert (text.results, text.tests) == ((), 0)


# ------------------------------------------------------------------------------------ JSON shapes


def validate(instance, schema, path="$"):
    """The part of JSON-Schema DCGM's two schema files use: type, properties, required, items (list = tuple)."""
    kinds = {"object": dict, "array": list, "string": str, "integer": int}
    kind = schema.get("type")
    if kind:
        assert isinstance(instance, kinds[kind]) and not isinstance(instance, bool), f"{path}: not {kind}"
    if kind == "object":
        for key in schema.get("required", ()):
            assert key in instance, f"{path}: {key} missing"
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                validate(instance[key], sub, f"{path}.{key}")
    if kind == "array":
        items = schema.get("items")
        subs = items if isinstance(items, list) else [items] * len(instance) if items else []
        for i, (value, sub) in enumerate(zip(instance, subs, strict=False)):  # a tuple schema may be shorter
            validate(value, sub, f"{path}[{i}]")


def test_built_documents_follow_dcgms_own_schemas():
    fail = {("memory", 1): {"status": "Fail", "warnings": [warning("x", 58, 10, 2)], "info": ["y"]}}
    validate(v4_doc(4, fail), json.loads(SCHEMA_4.read_text()))
    validate(v3_doc(8), json.loads(SCHEMA_3.read_text()))
    validate(json.loads(R2_PASS_T4.read_text())["DCGM GPU Diagnostic"],
             json.loads(SCHEMA_3.read_text())["properties"]["DCGM GPU Diagnostic"])


def test_dcgm4_results_per_entity_with_ids_and_metadata():
    doc = v4_doc(4, {("memory", 2): {"status": "Fail", "info": ["Allocated 85899345920 bytes (90.0%)"],
                                     "warnings": [warning("A memory mismatch was detected on GPU 2, but no error was "
                                                          "reported by CUDA or NVML.", 58, 10, 2)]}})
    run = diag_from_json(doc, "dcgmi diag -r 2 -j")
    assert (run.schema, run.version, run.driver_version, run.gpus_listed) == (
        "dcgm-4.x-json", "4.2.3", "570.124.06", (0, 1, 2, 3))
    (bad,) = [r for r in run.results if r.status == "fail"]
    assert (bad.category, bad.test, bad.gpu, bad.gpu_ids) == ("Hardware", "memory", 2, (2,))
    assert bad.errors == (DiagError("A memory mismatch was detected on GPU 2, but no error was reported by CUDA or "
                                    "NVML.", 58, 10, 2),)
    assert bad.info == ("Allocated 85899345920 bytes (90.0%)",)
    # the test_summary repeats the entity's error: no second, system-wide result
    assert len(run.results) == 12


def test_dcgm4_summary_counts_when_no_entity_carries_the_failure():
    doc = v4_doc(2)
    pcie = doc["DCGM Diagnostic"]["test_categories"][1]["tests"][0]
    pcie["test_summary"] = {"status": "Fail", "warnings": [warning("Only 16 NvLinks are up out of the expected 18",
                                                                   99, 11, 4)]}
    (summary,) = [r for r in diag_from_json(doc, "x").results if r.status == "fail"]
    assert (summary.test, summary.gpu, summary.error_ids) == ("pcie", None, (99,))
    del pcie["results"]  # a 4.x test with a summary only
    pcie["test_summary"] = {"status": "Skip"}
    assert [(r.test, r.gpu, r.status) for r in diag_from_json(doc, "x").results if r.test == "pcie"] == [
        ("pcie", None, "skip")]


def test_dcgm4_non_gpu_entities_and_runtime_error():
    doc = v4_doc(1)
    doc["DCGM Diagnostic"]["test_categories"][2]["tests"].append({"name": "cpu_eud", "results": [
        {"entity_group": "CPU", "entity_group_id": 7, "entity_id": 0, "status": "Fail"}],
        "test_summary": {"status": "Fail"}})
    (cpu,) = [r for r in diag_from_json(doc, "x").results if r.test == "cpu_eud"]
    assert (cpu.gpu, cpu.entity, cpu.status) == (None, "CPU 0", "fail")
    err = {"DCGM Diagnostic": {"version": "4.2.3", "runtime_error": "Error: Diagnostic could not be run while DCGM "
                                                                   "is paused."}}
    run = diag_from_json(err, "x")
    assert run.results == () and run.runtime_error.endswith("while DCGM is paused.") and run.version == "4.2.3"


def test_dcgm3_quirks():
    # Deployment: the GPU an error names in an int "gpu_id", the text under "warnings" (Diag.cpp 3.3);
    # per-GPU: "gpu_ids" lists, jsoncpp null slots, an old plain-string "warnings".
    doc = v3_doc(2, per_gpu={("PCIe", 1): {"status": "Fail", "warnings": [
        None, warning("GPU 1 host-side PCIe replay violation, see dmesg for more information", 98, 13, 4)]}},
        deployment={"Page Retirement/Row Remap": {"status": "Fail", "gpu_id": 1, "warnings": [
            warning("GPU 1 had memory errors and row remappings are pending", 85, 10, 6, key="warnings")]}})
    doc["DCGM GPU Diagnostic"]["test_categories"][2]["tests"][0]["results"] = [
        {"gpu_ids": "0,1", "status": "Fail", "warnings": "Cannot allocate memory"}]
    run = diag_from_json(doc, "x")
    remap = next(r for r in run.results if r.test == "Page Retirement/Row Remap")
    assert (remap.gpu, remap.gpu_ids, remap.error_ids, remap.errors[0].severity) == (None, (1,), (85,), 6)
    pcie = next(r for r in run.results if r.test == "PCIe" and r.gpu == 1)
    assert pcie.error_ids == (98,) and pcie.status == "fail"
    assert [(r.gpu, r.messages) for r in run.results if r.test == "GPU Memory"] == [
        (0, ("Cannot allocate memory",)), (1, ("Cannot allocate memory",))]
    assert run.gpus_listed == (0, 1) and run.version == "3.3.5" and run.driver_version == "550.90.07"


@pytest.mark.parametrize("doc, what", [
    ({"DCGM GPU Diagnostic": {}}, "no 'test_categories'"),
    ({"DCGM GPU Diagnostic": {"test_categories": {}}}, "test_categories is an object, not a list"),
    ({"DCGM GPU Diagnostic": {"test_categories": [{"tests": []}]}}, "test_categories[0].category is missing"),
    ({"DCGM GPU Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "GPU Memory",
      "results": [{"gpu_id": "0", "status": "Sort of"}]}]}]}}, "unknown status 'Sort of'"),
    ({"DCGM GPU Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "GPU Memory",
      "results": [{"gpu_id": "zero", "status": "Pass"}]}]}]}}, "results[0].gpu_id is a string, not an integer"),
    ([], "not an object"),
    ({"body": {}}, "not dcgmi diag -j output"),
])
def test_json_shape_errors_name_the_place(doc, what):
    with pytest.raises(ParseError) as err:
        diag_from_json(doc, "out.json")
    assert what in str(err.value)


def test_json_text_errors_carry_the_line():
    with pytest.raises(ParseError) as err:
        parse_dcgmi_diag_json('{\n  "DCGM GPU Diagnostic" : {\n    "test_categories" : [\n', "out.json")
    assert err.value.line == 4 and "malformed JSON" in err.value.what
    with pytest.raises(ParseError) as err:
        parse_dcgmi_diag_json("Error: Unable to connect to host engine.\n", "out.json")
    assert "no JSON object" in err.value.what and "Unable to connect" in err.value.what
    banner = "Successfully ran diagnostic for group.\n" + json.dumps(v3_doc(1), indent=2)
    assert len(parse_dcgmi_diag_json(banner, "x").results) == 11
    with pytest.raises(ParseError) as err:
        parse_dcgmi_diag_json("banner\n{\n  1\n}", "out.json")
    assert err.value.line == 3


# ------------------------------------------------------------------------------------ text


def v3_table():
    """The lines of a DCGM 3.x `dcgmi diag -r 3` table on 4 GPUs: Persistence Mode and GPU Memory fail."""
    return [*HEADER, "|-----  Metadata  ----------+------------------------------------------------|",
             row("DCGM Version", "3.3.5"), row("Driver Version Detected", "550.90.07"),
             row("GPU Device IDs Detected", "2330,2330,2330,2330"),
             "|-----  Deployment  --------+------------------------------------------------|",
             row("Denylist", "Pass"), row("Persistence Mode", "Fail"),
             *message_rows("Error", "Persistence mode for GPU 2 is disabled. Enable persistence mode by running "
                                    "\"nvidia-smi -i <gpuId> -pm 1 \" as root."),
             band("Integration"), row("PCIe", "Pass - All"), band("Hardware"), row("GPU Memory", "Fail - All"),
             *message_rows("Warning", "Couldn't allocate at least 75.0% of GPU memory on GPU 0"),
             *message_rows("Warning", "Couldn't allocate at least 75.0% of GPU memory on GPU 1"),
             band("Stress"), row("Targeted Stress", "Pass - GPUs: 0, 1, 2"), row("", "Warn - GPU: 3"),
             *message_rows("Warning", "Clocks are being throttled for GPU 3 because of clock throttling starting "
                                      "9.0 seconds into the test. HW_SLOWDOWN"),
             *FOOTER]


def test_dcgm3_full_table():
    run = parse_dcgmi_diag_text("\n".join(v3_table()), "diag.txt")
    assert run.problems == ()
    assert (run.version, run.driver_version, run.gpus_listed) == ("3.3.5", "550.90.07", (0, 1, 2, 3))
    persistence = next(r for r in run.results if r.test == "Persistence Mode")
    assert (persistence.gpu, persistence.status, persistence.gpu_ids) == (None, "fail", (2,))
    assert persistence.messages[0].endswith('-pm 1 " as root.')
    assert [(r.gpu, r.status) for r in run.results if r.test == "PCIe"] == [(g, "pass") for g in range(4)]
    memory = {r.gpu: r for r in run.results if r.test == "GPU Memory"}
    assert memory[0].messages == ("Couldn't allocate at least 75.0% of GPU memory on GPU 0",)
    assert memory[2].messages == () and memory[2].status == "fail"  # a warning is given to the GPU it names
    stress = {r.gpu: r.status for r in run.results if r.test == "Targeted Stress"}
    assert stress == {0: "pass", 1: "pass", 2: "pass", 3: "warn"}


def test_dcgm4_table():
    lines = [*HEADER, "|-----  Metadata  ----------+------------------------------------------------|",
             row("DCGM Version", "4.2.3"), row("GPU Device IDs Detected", "2335, 2335"),
             "|-----  Deployment  --------+------------------------------------------------|",
             row("software", "Pass"), row("", "GPU0: Pass"), row("", "GPU1: Pass"),
             band("Hardware"), row("memory", "Fail"), row("", "GPU0: Pass"), row("", "GPU1: Fail"),
             *message_rows("Warning: GPU1", "A memory mismatch was detected on GPU 1, but no error was reported "
                                            "by CUDA or NVML."),
             band("Integration"), row("pcie", "Warn"), *message_rows("Warning", "NVLink errors on the fabric"),
             row("", "GPU0: Pass"), row("", "GPU1: Pass"), *FOOTER]
    run = parse_dcgmi_diag_text("\n".join(lines), "diag.txt")
    memory = {r.gpu: r for r in run.results if r.test == "memory"}
    assert set(memory) == {0, 1} and memory[1].status == "fail" and memory[1].messages == (
        "A memory mismatch was detected on GPU 1, but no error was reported by CUDA or NVML.",)
    (pcie,) = [r for r in run.results if r.test == "pcie" and r.status != "pass"]
    assert (pcie.gpu, pcie.status, pcie.messages) == (None, "warn", ("NVLink errors on the fabric",))


def test_text_all_without_metadata_and_errors():
    run = parse_dcgmi_diag_text("\n".join([row("GPU Memory", "Fail - All")]), "x")
    assert [(r.gpu, r.all_gpus) for r in run.results] == [(None, True)]
    err = parse_dcgmi_diag_text("Error: Unable to complete diagnostic for group 2147483647. Return: (-38) "
                                "Host engine is not valid\n", "x")
    assert err.results == () and "Return: (-38)" in err.runtime_error
    for bad, what, line in [("hello\nworld\n", "no dcgmi diag result row", None),
                            (row("GPU Memory", "Sort of"), "unrecognised result 'Sort of'", 1),
                            ("\n" + row("", "continued text"), "outside any test", 2),
                            ("| just a bar", "without a column separator", 1)]:
        with pytest.raises(ParseError) as exc:
            parse_dcgmi_diag_text(bad, "x")
        assert what in exc.value.what and exc.value.line == line


def test_detectors():
    for path in outputs():
        text = path.read_text()
        json_like = path.suffix == ".json" and "DCGM GPU Diagnostic" in text and not path.name.startswith("dcgm__")
        assert looks_like_dcgmi_diag_json(text) == json_like, path.name
        assert looks_like_dcgmi_diag_text(text) == (path.suffix == ".txt"), path.name
    kmsg = "[  12.3] NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.\n"
    assert not looks_like_dcgmi_diag_json(kmsg) and not looks_like_dcgmi_diag_text(kmsg)
    assert looks_like_dcgmi_diag_json(json.dumps(v4_doc(1)))


# ------------------------------------------------------------------------------------ hostile input


def fails(run):
    return sorted((r.test, r.gpu) for r in run.results if r.status == "fail")


V3_FAILS = [("GPU Memory", g) for g in range(4)] + [("Persistence Mode", None)]


def with_line(lines, after, extra):
    at = next(i for i, ln in enumerate(lines) if after in ln) + 1
    return [*lines[:at], extra, *lines[at:]], at + 1


@pytest.mark.parametrize("edit", [
    lambda ln: ln.replace("Pass", "Pa\x00ss"),  # the status of a test that passed
    lambda ln: ln.replace("Denylist", "Deny\x00list"),  # its name: still read
    lambda ln: "\x00" + ln,
    lambda ln: ln.replace("| Pass", "\x00 Pass"),  # the column separator itself
])
def test_a_nul_byte_in_an_unrelated_row_does_not_hide_the_failures_of_the_others(edit, tmp_path):
    lines = v3_table()
    at = next(i for i, ln in enumerate(lines) if "Denylist" in ln)
    lines[at] = edit(lines[at])
    run = parse_dcgmi_diag_text("\n".join(lines), "diag.txt")
    assert fails(run) == V3_FAILS
    assert all(p.line == at + 1 and p.source == "diag.txt" for p in run.problems)
    # The same through `gpuwarden analyze`: FAIL, with the unreadable row named, never UNKNOWN.
    path = tmp_path / "diag.txt"
    path.write_text("\n".join(lines))
    result = analyze_file(path)
    assert result.status.name == "FAIL" and result.error is None
    if run.problems:
        assert any(f.code == "dcgm-unreadable-rows" and f.status.name == "UNKNOWN" for f in result.findings)
        assert any(f"diag.txt:{at + 1}" in note for note in result.notes)


def test_an_unreadable_status_is_unknown_not_passed(tmp_path):
    lines = v3_table()
    at = next(i for i, ln in enumerate(lines) if "Targeted Stress" in ln)
    lines[at] = lines[at].replace("Pass", "P\x00ss")
    run = parse_dcgmi_diag_text("\n".join(lines), "diag.txt")
    (problem,) = run.problems
    assert problem.line == at + 1 and "unrecognised result" in problem.what
    # the rows under it belong to the unreadable test, not to the test above it
    assert not any(r.test == "GPU Memory" and r.status == "warn" for r in run.results)
    path = tmp_path / "diag.txt"
    path.write_text("\n".join(row for row in lines if "Fail" not in row and "Error" not in row
                               and "Couldn't" not in row and "Persistence" not in row))
    assert analyze_file(path).status.name == "UNKNOWN"


@pytest.mark.parametrize("extra, after, what", [
    (row("", "GPU" + "9" * 5000 + ": Fail"), "Targeted Stress", "GPU id"),
    (row("", "Fail - GPUs: 1, " + "9" * 5000), "Targeted Stress", "GPU id"),
    (row("Warning: GPU" + "7" * 4400, "a message"), "Targeted Stress", "GPU id"),
    (row("GPU Device IDs Detected", ",".join(["2330"] * 5000)), "Driver Version", "5000 GPUs"),
])
def test_a_gpu_id_or_count_past_its_bound_is_a_problem_naming_the_line(extra, after, what):
    lines, at = with_line(v3_table(), after, extra)
    run = parse_dcgmi_diag_text("\n".join(lines), "diag.txt")
    (problem,) = run.problems
    assert problem.line == at and what in problem.what
    assert fails(run) == V3_FAILS


def test_json_gpu_ids_are_ascii_decimal_and_bounded():
    doc = v3_doc(2)
    doc["GPU Device Serials"]["\u00b2"] = "superscript two"  # "²".isdigit() is true; int("²") raises
    doc["GPU Device Serials"]["\u0661"] = "arabic-indic one"
    assert diag_from_json(doc, "x").gpus_listed == (0, 1)
    for big in (10 ** 30, 10 ** 5000):
        doc = v4_doc(1)
        doc["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][0]["entity_id"] = big
        with pytest.raises(ParseError) as err:
            diag_from_json(doc, "x")
        assert "entity_id" in err.value.what and "digits" in err.value.what
    doc = v3_doc(1, per_gpu={("PCIe", 0): {"gpu_id": "\u0661"}})
    with pytest.raises(ParseError, match="gpu_id"):
        diag_from_json(doc, "x")


@pytest.mark.parametrize("extra", [
    "+- a" + " " * MIB + "b",  # the old band pattern took hours here
    "|-----  Hardware" + " " * MIB + "  ------+---|",
    "+" + "-" * MIB + "x",
    row("", "Pass - GPUs: " + "1, " * (MIB // 3) + "x"),
    row("", "GPU" + " " * MIB + "1: Pass"),
    row("Warning: GPU" + " " * MIB, "x"),
    row("Diagnostic" + " " * MIB + "Test Version", "1"),
])
def test_a_pathological_1mib_row_is_read_in_linear_time(extra):
    lines, _ = with_line(v3_table(), "Targeted Stress", extra)
    with deadline():
        run = parse_dcgmi_diag_text("\n".join(lines), "diag.txt")
    assert fails(run) == V3_FAILS


# ------------------------------------------------------------------------------------ fuzzing
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_rows = st.lists(st.one_of(
    st.builds(row, st.sampled_from(["", "Warning", "Error", "Info", "GPU Memory", "memory", "Warning: GPU1",
                                    "DCGM Version", "GPU Device IDs Detected"]),
              st.sampled_from(["Pass", "Fail - All", "Pass - GPUs: 1, 2", "GPU0: Fail", "Warn - GPU: 3", "x" * 45,
                               "Skip - All", "2330,2330", "Not Run", ""]) | st.text(max_size=50)),
    st.sampled_from([*HEADER, *FOOTER, band("Stress"), band("Deployment", "|"), "| no separator", "+", "|"]),
    st.text(max_size=80)), max_size=30).map("\n".join)


@FUZZ
@given(st.text(max_size=2000) | _rows)
def test_text_parser_raises_only_parse_error(text):
    try:
        parse_dcgmi_diag_text(text, "fuzz")
    except ParseError:
        pass


_scalars = st.none() | st.booleans() | st.integers(-2, 2 ** 70) | st.text(max_size=12) | st.sampled_from(
    ["Pass", "Fail", "Skip", "Warn", "0", "0,1", "GPU", "Not Run"])
_any = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["status", "gpu_id", "gpu_ids", "warnings", "warning", "info", "error_id", "name", "results",
                     "tests", "category", "entity_group", "entity_id", "entity_group_id", "test_summary",
                     "cpu_id", "runtime_error", "version", "entities"]), inner, max_size=4), max_leaves=20)
_result = st.fixed_dictionaries({"status": st.sampled_from(["Pass", "Fail", "Skip"]) | _scalars},
                                optional={"gpu_id": _any, "gpu_ids": _any, "warnings": _any, "info": _any,
                                          "entity_group": _any, "entity_id": _any, "cpu_id": _any})
_test = st.fixed_dictionaries({"name": st.sampled_from(["GPU Memory", "memory"]) | _scalars},
                              optional={"results": st.lists(_result | _any, max_size=3), "test_summary": _any})
_doc = st.builds(lambda root, body, extra: {root: body, **extra},
                 st.sampled_from(["DCGM GPU Diagnostic", "DCGM Diagnostic"]),
                 st.fixed_dictionaries({}, optional={"test_categories": st.lists(st.fixed_dictionaries(
                     {}, optional={"category": _scalars, "tests": st.lists(_test | _any, max_size=3) | _any}),
                     max_size=3) | _any, "runtime_error": _any, "version": _any}) | _any,
                 st.dictionaries(st.sampled_from(["entity_groups", "metadata", "GPU Device Serials",
                                                  "GPU Device IDs", "version"]), _any, max_size=3))


@FUZZ
@given(_doc | _any)
def test_json_walker_raises_only_parse_error(doc):
    try:
        diag_from_json(doc, "fuzz")
    except ParseError:
        pass
    try:
        parse_dcgmi_diag_json(json.dumps(doc), "fuzz")
    except ParseError:
        pass


@FUZZ
@given(st.text(max_size=500).map(lambda t: "{" + t) | st.text(max_size=500))
def test_json_parser_raises_only_parse_error_on_text(text):
    try:
        parse_dcgmi_diag_json(text, "fuzz")
    except ParseError:
        pass
