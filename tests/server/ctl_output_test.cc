// geofp8ctl's structured output and client-side logic without a server: JSON with 64-bit integers
// as numbers, YAML whose strings read back as strings, JSONPath templates, the config file and
// its errors, the watch ETA's step rate, the piped watch's throttle, and the completion script.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "client/ctl/config.h"
#include "client/ctl/doc.h"
#include "client/ctl/render.h"
#include "platform/policy/policy.h"
#include "yaml-cpp/yaml.h"

namespace geofp8::ctl {
namespace {

v1::Job SampleJob() {
  v1::Job job;
  job.set_id("job-000001");
  job.set_name("true");
  job.set_state(v1::JOB_RUNNING);
  job.set_world_size(2);
  job.set_created_unix_ms(1764590000123);
  auto* p = job.mutable_progress();
  p->set_step(41);
  p->set_total_steps(300);
  p->set_loss(3.5);
  p->set_bytes_sent(9007199254740993ull);  // 2^53 + 1: exact only as an integer
  return job;
}

TEST(CtlOutput, JsonPrintsInt64AsNumbers) {
  const std::string json = ToJson(SampleJob());
  // protobuf's JsonPrintOptions would write "9007199254740993" as a string.
  EXPECT_NE(json.find("\"bytes_sent\": 9007199254740993,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"step\": 42,"), std::string::npos) << json;  // steps done: 0..41
  EXPECT_NE(json.find("\"world_size\": 2,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"state\": \"running\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"loss\": 3.5,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"ranks\": []"), std::string::npos) << json;
  // Every field is present, unset ones with their default.
  EXPECT_NE(json.find("\"reason\": \"\""), std::string::npos) << json;
  EXPECT_EQ(json.back(), '\n');
}

TEST(CtlOutput, JsonEscapesAndNonFiniteNumbers) {
  Doc d = Doc::Object();
  d.Add("s", Doc::String("a\"b\\c\n\x01"));
  d.Add("nan", Doc::Double(std::nan("")));
  d.Add("inf", Doc::Double(-INFINITY));
  d.Add("tenth", Doc::Double(0.1));
  EXPECT_EQ(DocToJson(d),
            "{\n  \"s\": \"a\\\"b\\\\c\\n\\u0001\",\n  \"nan\": \"NaN\",\n  \"inf\": "
            "\"-Infinity\",\n  \"tenth\": 0.1\n}\n");
}

TEST(CtlOutput, FloatFieldsPrintTheirShortestDecimal) {
  v1::LayerPatch p;
  p.set_alpha(0.1f);  // a float: 0.100000001490116... as a double
  EXPECT_NE(ToJson(p).find("\"alpha\": 0.1,"), std::string::npos) << ToJson(p);
}

TEST(CtlOutput, YamlQuotesStringsThatWouldReadAsOtherTypes) {
  for (const char* s :
       {"true",   "False", "yes",        "NO",   "on",   "off",   "y",      "null",
        "~",      "1.5",   "-3",         "0x1",  "0o7",  "1e3",   ".5",     ".inf",
        "-.Inf",  ".NaN",  "2026-12-01", "1:30", "",     " lead", "trail ", "a: b",
        "a #c",   "- x",   "*ref",       "&a",   "!tag", "@x",    "`x",     "line\nbreak",
        "tab\tx", "{x}",   "[x]",        "%x",   "'q",   "\"q",   "=",      "<<"}) {
    EXPECT_TRUE(YamlNeedsQuotes(s)) << s;
  }
  for (const char* s : {"job-000001", "demo-local", "JOB_RUNNING", "layers.*.mlp.*", "fp8_e4m3",
                        "truex", "nullable", "a1.5", "v1", "hello world", "x:y"}) {
    EXPECT_FALSE(YamlNeedsQuotes(s)) << s;
  }
}

TEST(CtlOutput, YamlReadsBackWithTheSameTypes) {
  v1::Job job = SampleJob();
  job.set_reason("1.5");
  job.set_idempotency_key("null");
  job.set_scheduling("0x1");
  job.add_events()->set_message("line one\nline two: \"quoted\"");
  const std::string yaml = ToYaml(job);
  EXPECT_NE(yaml.find("name: \"true\"\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("reason: \"1.5\"\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("idempotency_key: \"null\"\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("scheduling: \"0x1\"\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  bytes_sent: 9007199254740993\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  loss: 3.5\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("ranks: []\n"), std::string::npos) << yaml;
  EXPECT_EQ(yaml.find('{'), std::string::npos) << yaml;  // block style
  // yaml-cpp parses it; a quoted scalar carries the non-specific tag "!", a plain one "?".
  YAML::Node n = YAML::Load(yaml);
  EXPECT_EQ(n["name"].as<std::string>(), "true");
  EXPECT_EQ(n["name"].Tag(), "!");
  EXPECT_EQ(n["id"].as<std::string>(), "job-000001");
  EXPECT_EQ(n["world_size"].as<int>(), 2);
  EXPECT_EQ(n["progress"]["bytes_sent"].as<uint64_t>(), 9007199254740993ull);
  EXPECT_EQ(n["events"][0]["message"].as<std::string>(), "line one\nline two: \"quoted\"");
  EXPECT_EQ(n["events"][0]["state"].as<std::string>(), "unspecified");
  EXPECT_EQ(n["created_time"].as<std::string>(), "2025-12-01T11:53:20.123Z");
  EXPECT_TRUE(n["events"][0]["time"].IsNull());
}

// Issue #29: -o json and yaml name enums as the table, --state and the job spec do, and print
// times as RFC 3339 UTC; the wire keeps the proto enums and Unix milliseconds.
TEST(CtlOutput, EnumsPrintAsTheTableAndTheSpecNameThem) {
  for (int v = v1::Format_MIN + 1; v <= v1::Format_MAX; ++v) {
    v1::LayerPolicy p;
    p.set_format(static_cast<v1::Format>(v));
    p.set_scaling(static_cast<v1::Scaling>(std::min(v, int(v1::Scaling_MAX))));
    p.set_rounding(static_cast<v1::Rounding>(std::min(v, int(v1::Rounding_MAX))));
    p.set_geometry(static_cast<v1::GeometryMode>(std::min(v, int(v1::GeometryMode_MAX))));
    const Doc d = OutputDoc(p);
    EXPECT_EQ(d.Find("format")->s, NameOf(p.format())) << v;
    EXPECT_EQ(d.Find("scaling")->s, NameOf(p.scaling())) << v;
    EXPECT_EQ(d.Find("rounding")->s, NameOf(p.rounding())) << v;
    EXPECT_EQ(d.Find("geometry")->s, NameOf(p.geometry())) << v;
  }
  EXPECT_EQ(OutputDoc(v1::LayerPolicy()).Find("format")->s, "unspecified");
  for (int v = v1::JobState_MIN + 1; v <= v1::JobState_MAX; ++v) {
    v1::Job job;
    job.set_state(static_cast<v1::JobState>(v));
    std::string lower = StateName(job.state());
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    EXPECT_EQ(OutputDoc(job).Find("state")->s, lower);  // what --state accepts
  }
  v1::Worker w;
  w.set_state(v1::WORKER_DISCONNECTED);
  EXPECT_EQ(OutputDoc(w).Find("state")->s, "disconnected");
  v1::Stop stop;
  stop.set_cause(v1::STOP_JOB_SUCCEEDED);
  EXPECT_EQ(OutputDoc(stop).Find("cause")->s, "job_succeeded");
  v1::ProbeResult probe;
  probe.set_basis(v1::PROBE_BASIS_SHADOW);
  EXPECT_EQ(OutputDoc(probe).Find("basis")->s, "shadow");
}

TEST(CtlOutput, TimesPrintAsRfc3339Utc) {
  EXPECT_EQ(Rfc3339(0), "1970-01-01T00:00:00.000Z");
  EXPECT_EQ(Rfc3339(1764590000123), "2025-12-01T11:53:20.123Z");
  EXPECT_EQ(Rfc3339(951782400999), "2000-02-29T00:00:00.999Z");  // a leap day
  EXPECT_EQ(Rfc3339(-1), "1969-12-31T23:59:59.999Z");
  v1::Job job = SampleJob();
  job.add_events()->set_unix_ms(1764590001000);
  job.mutable_progress()->set_updated_unix_ms(1764590002005);
  const std::string json = ToJson(job);
  EXPECT_NE(json.find("\"created_time\": \"2025-12-01T11:53:20.123Z\","), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"updated_time\": null,"), std::string::npos) << json;  // never set
  EXPECT_NE(json.find("\"updated_time\": \"2025-12-01T11:53:22.005Z\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"time\": \"2025-12-01T11:53:21.000Z\""), std::string::npos) << json;
  EXPECT_EQ(json.find("unix_ms"), std::string::npos) << json;
  v1::Worker w;
  w.set_last_heartbeat_unix_ms(1764590000123);
  EXPECT_EQ(OutputDoc(w).Find("last_heartbeat_time")->s, "2025-12-01T11:53:20.123Z");
  // YAML quotes the time, so that a YAML 1.1 reader keeps it a string, not a timestamp.
  EXPECT_NE(ToYaml(job).find("created_time: \"2025-12-01T11:53:20.123Z\"\n"), std::string::npos)
      << ToYaml(job);
}

// The step in the document is the table's (steps done): the docs' example printed 199/200 for
// a finished 200-step job, whose progress.step on the wire is 199 (the last index completed).
TEST(CtlOutput, TheStepIsCountedAsTheTableCountsIt) {
  v1::Job job = SampleJob();
  job.set_state(v1::JOB_SUCCEEDED);
  job.mutable_progress()->set_step(199);
  job.mutable_progress()->set_total_steps(200);
  job.mutable_progress()->set_val_loss(2.5);
  job.mutable_progress()->set_val_step(179);
  const std::string tmpl = "{.progress.step}/{.progress.total_steps}";
  EXPECT_EQ(*JsonPath(OutputDoc(job), tmpl), "200/200");
  EXPECT_NE(JobsTable({job}, 0).find(" 200/200 "), std::string::npos) << JobsTable({job}, 0);
  EXPECT_EQ(*JsonPath(OutputDoc(job), "{.progress.val_step}"), "180");
  EXPECT_NE(DescribeJob(job, nullptr, 0).find("after step 180"), std::string::npos);
  job.set_state(v1::JOB_RUNNING);
  job.mutable_progress()->set_step(41);
  EXPECT_EQ(*JsonPath(OutputDoc(job), tmpl), "42/200");
  EXPECT_NE(JobsTable({job}, 0).find(" 42/200 "), std::string::npos) << JobsTable({job}, 0);
  job.set_state(v1::JOB_PENDING);
  job.mutable_progress()->set_step(0);
  job.mutable_progress()->clear_val_loss();  // no validation yet: val_step 0 as on the wire
  job.mutable_progress()->clear_val_step();
  EXPECT_EQ(*JsonPath(OutputDoc(job), tmpl), "0/200");
  EXPECT_EQ(*JsonPath(OutputDoc(job), "{.progress.val_step}"), "0");
  // Inside a list, a watch update and a delete reply alike.
  v1::ListJobsResponse list;
  *list.add_jobs() = job;
  list.mutable_jobs(0)->set_state(v1::JOB_SUCCEEDED);
  EXPECT_EQ(*JsonPath(OutputDoc(list), "{.jobs[0].progress.step}"), "200");
  v1::WatchJobResponse watch;
  *watch.mutable_job() = list.jobs(0);
  EXPECT_EQ(*JsonPath(OutputDoc(watch), "{.job.progress.step}"), "200");
}

TEST(CtlOutput, YamlFloatsKeepADotOrExponentForYaml11Readers) {
  Doc d = Doc::Object();
  d.Add("a", Doc::Double(3));
  d.Add("b", Doc::Double(1e-5));
  d.Add("c", Doc::Double(std::nan("")));
  d.Add("nested", Doc::Array());
  d.fields.back().second.items.push_back(Doc::Array());
  d.fields.back().second.items.back().items.push_back(Doc::Int(1));
  d.fields.back().second.items.push_back(Doc::Object());
  EXPECT_EQ(DocToYaml(d), "a: 3.0\nb: 1.0e-05\nc: .nan\nnested:\n  -\n    - 1\n  - {}\n");
}

TEST(CtlOutput, JsonPathSubset) {
  v1::ListJobsResponse list;
  *list.add_jobs() = SampleJob();
  v1::Job second = SampleJob();
  second.set_id("job-000002");
  second.set_name("b");
  *list.add_jobs() = second;
  const Doc d = FromProto(list);
  EXPECT_EQ(*JsonPath(d, "{.jobs[*].name}"), "true b");
  EXPECT_EQ(*JsonPath(d, "{.jobs[0].progress.step}"), "41");
  EXPECT_EQ(*JsonPath(d, "{$.jobs[-1].id}"), "job-000002");
  EXPECT_EQ(*JsonPath(d, "{.jobs[1]['id']}"), "job-000002");
  EXPECT_EQ(*JsonPath(d, "id={.jobs[0].id}{\"\\n\"}"), "id=job-000001\n");
  EXPECT_EQ(*JsonPath(d, "{.jobs[0].ranks}"), "[]");
  EXPECT_EQ(*JsonPath(d, "{.jobs[0].progress.loss} {.jobs[0].progress.bytes_sent}"),
            "3.5 9007199254740993");
  EXPECT_EQ(JsonPath(FromProto(SampleJob()), "{.progress.*}")->substr(0, 7), "41 300 ");
  // Unsupported syntax and missing fields are errors that name the expression.
  for (const char* bad : {"{.jobs[?(@.name=='b')].id}", "{..id}", "{range .jobs[*]}{.id}{end}",
                          "{.jobs[0:1]}", "{.jobs[0}", "{jobs}", "{.jobs[0].nope}", "{.jobs[5]}",
                          "}", "{.jobs", "{.jobs[0].progress.step.x}"}) {
    auto r = JsonPath(d, bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_NE(std::string(r.status().message()).find("jsonpath"), std::string::npos) << r.status();
  }
  EXPECT_NE(std::string(JsonPath(d, "{.jobs[0].nope}").status().message()).find("no field 'nope'"),
            std::string::npos);
  // Syntax alone, before any call: what needs the document passes, what no document could
  // satisfy does not.
  EXPECT_TRUE(CheckJsonPath("{.jobs[0].nope} {$} {.} x{\"\\n\"}").ok());
  for (const char* bad : {"{.jobs[?(@.name=='b')].id}", "{..id}", "{range .jobs[*]}",
                          "{.jobs[0:1]}", "{jobs}", "}", "{.jobs", ""}) {
    EXPECT_FALSE(CheckJsonPath(bad).ok()) << bad;
  }
}

TEST(CtlOutput, ConfigParsesContextsAndNamesLineAndFieldOfErrors) {
  const std::string good =
      "current-context: b\n"
      "contexts:\n"
      "  - name: a\n"
      "    server: 127.0.0.1:7070\n"
      "  - name: b\n"
      "    server: coord:7070\n"
      "    token-file: token\n"
      "    ca: /etc/ca.crt\n";
  auto c = ParseConfig(good, "/home/u/.config/geofp8/config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->current_context, "b");
  ASSERT_EQ(c->contexts.size(), 2u);
  EXPECT_EQ(c->Find("b")->server, "coord:7070");
  EXPECT_EQ(ResolvePath(c->path, c->Find("b")->token_file), "/home/u/.config/geofp8/token");
  EXPECT_EQ(ResolvePath(c->path, "/etc/ca.crt"), "/etc/ca.crt");

  struct Bad {
    const char* text;
    const char* error;
  };
  for (const Bad& b : std::vector<Bad>{
           {"contexts:\n  - name: a\n    sever: x\n",
            "cfg.yaml:3: contexts[0].sever: unknown field; accepted: name, server, token-file"},
           {"contexts:\n  - server: x\n", "cfg.yaml:2: contexts[0].name: required"},
           {"current-context: z\ncontexts:\n  - name: a\n",
            "cfg.yaml:1: current-context: no context named z"},
           {"contexts:\n  - name: a\n  - name: a\n", "cfg.yaml:3: contexts[1].name: duplicate"},
           {"contexts: 3\n", "cfg.yaml:1: contexts: must be a list"},
           {"contexts:\n  - name: a\n    server: [x]\n",
            "cfg.yaml:3: contexts[0].server: must be a string"},
           {"contexts:\n  - name: a\n    cert: c.pem\n", "cfg.yaml:2: contexts[0].key: required"},
           {"servers: x\n", "cfg.yaml:1: servers: unknown field"},
           {"contexts: [\n", "cfg.yaml:"},
       }) {
    auto r = ParseConfig(b.text, "cfg.yaml");
    ASSERT_FALSE(r.ok()) << b.text;
    EXPECT_EQ(std::string(r.status().message()).rfind(b.error, 0), 0u)
        << r.status() << "\nexpected prefix: " << b.error;
  }
}

TEST(CtlOutput, ConfigRoundTripsThroughTheFile) {
  const std::string dir = ::testing::TempDir() + "/ctl_cfg_" + std::to_string(::getpid());
  Config c;
  c.path = dir + "/sub/config.yaml";
  c.current_context = "true";  // a name that YAML would read as a bool unless quoted
  c.contexts.push_back(Context{"true", "h:1", "/t", "", "", ""});
  c.contexts.push_back(Context{"1.5", "h:2", "", "/ca", "/c", "/k"});
  ASSERT_TRUE(SaveConfig(c).ok());
  EXPECT_EQ(std::filesystem::status(c.path).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  auto back = LoadConfig(c.path, true);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->current_context, "true");
  ASSERT_EQ(back->contexts.size(), 2u);
  EXPECT_EQ(back->contexts[1].name, "1.5");
  EXPECT_EQ(back->contexts[1].key, "/k");
  EXPECT_EQ(back->contexts[0].token_file, "/t");
  auto missing = LoadConfig(dir + "/none.yaml", false);
  ASSERT_TRUE(missing.ok());
  EXPECT_FALSE(missing->exists);
  EXPECT_FALSE(LoadConfig(dir + "/none.yaml", true).ok());
  std::filesystem::remove_all(dir);
}

TEST(CtlOutput, StepRateIsSteadyAndWaitsForData) {
  StepRate rate(30, 5);
  EXPECT_EQ(rate.Rate(), 0);
  rate.Add(0, 0);
  rate.Add(1, 10);
  EXPECT_EQ(rate.Rate(), 0);  // 1 s of data: under min_span, no ETA ("--")
  // 10 steps/s with reports arriving in bursts: every 0.3 s, alternately 1 and 5 steps.
  double t = 1;
  int64_t steps = 10;
  double lo = 1e9, hi = 0;
  for (int i = 0; i < 400; ++i) {
    t += 0.3;
    steps += i % 2 ? 5 : 1;
    rate.Add(t, steps);
    if (t > 6) {
      lo = std::min(lo, rate.Rate());
      hi = std::max(hi, rate.Rate());
    }
  }
  // The true rate is 3 steps / 0.3 s = 10/s. Over a window of >= 5 s (>= 16 intervals), a window
  // edge misplaced by one burst changes the count by at most 5 steps: 10 +- 5/5 = [9, 11]. The
  // per-interval rate would swing between 3.3 and 16.7.
  EXPECT_GE(lo, 9.0);
  EXPECT_LE(hi, 11.0);
  // A slowdown shows within the window: after 30 s at 2 steps/s the rate is 2.
  for (int i = 0; i < 200; ++i) {
    t += 0.5;
    steps += 1;
    rate.Add(t, steps);
  }
  EXPECT_NEAR(rate.Rate(), 2.0, 1e-9);
  // A restart (steps go back) starts over: no estimate until 5 s of new data.
  rate.Add(t + 1, 100);
  EXPECT_EQ(rate.Rate(), 0);
}

TEST(CtlOutput, PipedWatchPrintsStateChangesAndEveryTenPercent) {
  WatchThrottle throttle(10);
  v1::Job job;
  job.set_state(v1::JOB_PENDING);
  job.mutable_progress()->set_total_steps(1000);
  int printed = 0;
  if (throttle.ShouldPrint(job)) ++printed;  // the first update
  job.set_state(v1::JOB_RUNNING);
  for (int step = 0; step < 1000; ++step) {
    job.mutable_progress()->set_step(step);
    if (throttle.ShouldPrint(job)) ++printed;
  }
  job.set_state(v1::JOB_SUCCEEDED);
  if (throttle.ShouldPrint(job)) ++printed;
  // PENDING, RUNNING (step 0 = 1 done, bucket 0), buckets 1..9 (100..900 done), and 100% (1000
  // done, the last RUNNING update) then SUCCEEDED: 1 + 1 + 9 + 1 + 1 = 13 lines for 1002 updates.
  EXPECT_EQ(printed, 13);
  WatchThrottle every(0);
  EXPECT_TRUE(every.ShouldPrint(job));
  EXPECT_TRUE(every.ShouldPrint(job));
}

TEST(CtlOutput, WideAndNameColumns) {
  v1::Job job = SampleJob();
  job.add_ranks()->set_worker_id("w-1");
  job.add_ranks()->set_worker_id("w-2");
  job.mutable_progress()->set_bytes_sent(25);
  job.mutable_progress()->set_bytes_baseline(100);
  const std::string wide = JobsWideTable({job}, job.created_unix_ms() + 90000);
  EXPECT_NE(wide.find("LOSS"), std::string::npos) << wide;
  EXPECT_NE(wide.find("42/300"), std::string::npos) << wide;  // step 41 is the 42nd
  EXPECT_NE(wide.find("75%"), std::string::npos) << wide;
  EXPECT_NE(wide.find("w-1,w-2"), std::string::npos) << wide;
  EXPECT_NE(wide.find("1m30s"), std::string::npos) << wide;
  EXPECT_NE(JobsTable({job}, 0).find("42/300"), std::string::npos);
}

TEST(CtlOutput, CompletionScriptListsCommandsAndParses) {
  CommandNode root{
      "geofp8ctl", {{"--server", true}, {"-o", true}, {"--help", false}}, {}, false, {}};
  CommandNode get{"get", {}, {}, false, {}};
  get.children.push_back(CommandNode{"jobs", {{"--limit", true}}, {}, false, {}});
  get.children.push_back(CommandNode{"job", {}, {}, true, {}});
  root.children.push_back(get);
  root.children.push_back(CommandNode{"completion", {}, {"bash", "zsh"}, false, {}});
  const std::string bash = CompletionScript(root, "bash");
  EXPECT_NE(bash.find("complete -o default -F _geofp8ctl geofp8ctl"), std::string::npos);
  EXPECT_NE(bash.find("\"\") echo \"get completion\""), std::string::npos) << bash;
  EXPECT_NE(bash.find("\"get jobs\") echo \"--server -o --help --limit\""), std::string::npos)
      << bash;
  EXPECT_NE(CompletionScript(root, "zsh").find("bashcompinit"), std::string::npos);
  // bash itself: the script parses, and completing "geofp8ctl g" offers "get".
  const std::string path = ::testing::TempDir() + "/ctl_completion_" + std::to_string(::getpid());
  std::ofstream(path) << bash
                      << "COMP_WORDS=(geofp8ctl g); COMP_CWORD=1; _geofp8ctl; "
                         "echo \"${COMPREPLY[*]}\"\n"
                         "COMP_WORDS=(geofp8ctl -o json get ''); COMP_CWORD=4; _geofp8ctl; "
                         "echo \"${COMPREPLY[*]}\"\n"
                         "COMP_WORDS=(geofp8ctl completion ''); COMP_CWORD=2; _geofp8ctl; "
                         "echo \"${COMPREPLY[*]}\"\n";
  ASSERT_EQ(std::system(("bash -n " + path).c_str()), 0);
  FILE* f = ::popen(("bash " + path).c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, f)) out += buf;
  ::pclose(f);
  std::remove(path.c_str());
  EXPECT_EQ(out, "get\njobs job\nbash zsh\n");
}

}  // namespace
}  // namespace geofp8::ctl
