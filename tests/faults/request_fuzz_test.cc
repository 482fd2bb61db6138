// Every field of every coordinator RPC at its extremes (#41 item 1), generated from the proto
// descriptors so that a new field or RPC is covered without a new test: strings at 1 MiB,
// repeated fields at 100,000 entries, integers at their minimum, -1 and maximum, enums at an
// unknown value. Each case goes through a generic stub with a valid token to the real gRPC server
// (in process, on 127.0.0.1); after each one the server must still answer ListJobs and
// ListWorkers, and a refusal must name the field (with the bound and length where the edge's
// bounds refuse it: proto/bounds.h).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "proto/bounds.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/grpc_services.h"
#include "server/coordinator/metrics.h"
#include "server/coordinator/store.h"

namespace geofp8::coordinator {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::MethodDescriptor;

constexpr char kToken[] = "fuzz-token";
constexpr size_t kBigString = size_t{1} << 20;
constexpr int kManyEntries = 100000;

// One call's outcome: its status and how many messages came back.
struct Outcome {
  grpc::Status status;
  int responses = 0;
};

// Sends one request to any method (unary or streaming: the wire is the same) and reads every
// answer until the server ends the call.
class OneShot final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  OneShot(grpc::GenericStub* stub, const std::string& method, const std::string& request) {
    grpc::Slice slice(request);
    request_ = grpc::ByteBuffer(&slice, 1);
    ctx_.AddMetadata("authorization", std::string("Bearer ") + kToken);
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stub->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    StartWrite(&request_, grpc::WriteOptions().set_last_message());
    StartRead(&response_);
    StartCall();
  }
  Outcome Wait() { return done_.get_future().get(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    ++outcome_.responses;
    StartRead(&response_);
  }
  void OnDone(const grpc::Status& s) override {
    outcome_.status = s;
    done_.set_value(outcome_);
  }

 private:
  grpc::ClientContext ctx_;
  grpc::ByteBuffer request_, response_;
  Outcome outcome_;
  std::promise<Outcome> done_;
};

// A field to reach from the request: its parents (a repeated parent gets one element) and itself.
struct FieldPath {
  std::vector<const FieldDescriptor*> chain;
  std::string Name() const {
    std::string p;
    for (size_t i = 0; i < chain.size(); ++i) {
      if (i) p += ".";
      p += chain[i]->name();
      if (i + 1 < chain.size() && chain[i]->is_repeated()) p += "[0]";
    }
    return p;
  }
};

struct Case {
  FieldPath path;
  std::string what;  // "1 MiB", "100000 entries", "-1", "unknown enum"
  std::function<void(Message*, const FieldDescriptor*)> set;
  // What the edge must answer (from the bounds table), or empty when the value is within it.
  std::string expected_refusal;
};

Message* Parent(Message* root, const FieldPath& path) {
  Message* m = root;
  for (size_t i = 0; i + 1 < path.chain.size(); ++i) {
    const FieldDescriptor* f = path.chain[i];
    const auto* r = m->GetReflection();
    if (f->is_repeated()) {
      m = r->FieldSize(*m, f) > 0 ? r->MutableRepeatedMessage(m, f, 0) : r->AddMessage(m, f);
    } else {
      m = r->MutableMessage(m, f);
    }
  }
  return m;
}

std::string Cut(const std::string& s) { return s.size() > 300 ? s.substr(0, 300) + "..." : s; }

// The cases of every field reachable from `d` (messages nested up to 3 deep).
void Generate(const Descriptor* d, FieldPath prefix, std::vector<Case>* out) {
  if (prefix.chain.size() >= 3) return;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    FieldPath path = prefix;
    path.chain.push_back(f);
    const bounds::Bound b =
        bounds::BoundOf(d->name(), f->name(), f->type() == FieldDescriptor::TYPE_BYTES);
    const std::string name = path.Name();
    if (f->is_repeated()) {
      out->push_back(
          {path, std::to_string(kManyEntries) + " entries",
           [](Message* m, const FieldDescriptor* f) {
             const auto* r = m->GetReflection();
             for (int k = 0; k < kManyEntries; ++k) {
               switch (f->cpp_type()) {
                 case FieldDescriptor::CPPTYPE_MESSAGE:
                   r->AddMessage(m, f);
                   break;
                 case FieldDescriptor::CPPTYPE_STRING:
                   r->AddString(m, f, "k");
                   break;
                 case FieldDescriptor::CPPTYPE_ENUM:
                   r->AddEnumValue(
                       m, f, f->enum_type()->value(f->enum_type()->value_count() - 1)->number());
                   break;
                 case FieldDescriptor::CPPTYPE_INT32:
                   r->AddInt32(m, f, 1);
                   break;
                 case FieldDescriptor::CPPTYPE_INT64:
                   r->AddInt64(m, f, 1);
                   break;
                 case FieldDescriptor::CPPTYPE_UINT32:
                   r->AddUInt32(m, f, 1);
                   break;
                 case FieldDescriptor::CPPTYPE_UINT64:
                   r->AddUInt64(m, f, 1);
                   break;
                 case FieldDescriptor::CPPTYPE_BOOL:
                   r->AddBool(m, f, true);
                   break;
                 case FieldDescriptor::CPPTYPE_FLOAT:
                   r->AddFloat(m, f, 1);
                   break;
                 case FieldDescriptor::CPPTYPE_DOUBLE:
                   r->AddDouble(m, f, 1);
                   break;
               }
             }
           },
           kManyEntries > static_cast<int>(b.max_entries)
               ? name + ": at most " + std::to_string(b.max_entries) + " entries ("
               : ""});  // the count: 100000, or one more where the base request holds one
    }
    const std::string element = f->is_repeated() ? name + "[0]" : name;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        Generate(f->message_type(), path, out);
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        out->push_back({path, "1 MiB",
                        [](Message* m, const FieldDescriptor* f) {
                          const std::string big(kBigString, 'a');
                          if (f->is_repeated()) {
                            m->GetReflection()->AddString(m, f, big);
                          } else {
                            m->GetReflection()->SetString(m, f, big);
                          }
                        },
                        kBigString > b.max_bytes
                            ? element + ": at most " + std::to_string(b.max_bytes) + " bytes (" +
                                  std::to_string(kBigString) + ")"
                            : ""});
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        out->push_back({path, "unknown enum value 12345",
                        [](Message* m, const FieldDescriptor* f) {
                          if (f->is_repeated()) {
                            m->GetReflection()->AddEnumValue(m, f, 12345);
                          } else {
                            m->GetReflection()->SetEnumValue(m, f, 12345);
                          }
                        },
                        element + ": unknown " + f->enum_type()->full_name() + " value (12345)"});
        break;
      case FieldDescriptor::CPPTYPE_INT32:
      case FieldDescriptor::CPPTYPE_INT64: {
        const bool wide = f->cpp_type() == FieldDescriptor::CPPTYPE_INT64;
        const int64_t lo =
            wide ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int32_t>::min();
        const int64_t hi =
            wide ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int32_t>::max();
        for (int64_t v : {lo, int64_t{-1}, hi}) {
          std::string refusal;
          if (b.min_value && v < *b.min_value) {
            refusal = element + ": must be >= " + std::to_string(*b.min_value) + " (" +
                      std::to_string(v) + ")";
          } else if (b.max_value && v > *b.max_value) {
            refusal = element + ": must be <= " + std::to_string(*b.max_value) + " (" +
                      std::to_string(v) + ")";
          }
          out->push_back(
              {path, std::to_string(v),
               [v, wide](Message* m, const FieldDescriptor* f) {
                 const auto* r = m->GetReflection();
                 if (f->is_repeated()) {
                   wide ? r->AddInt64(m, f, v) : r->AddInt32(m, f, static_cast<int32_t>(v));
                 } else {
                   wide ? r->SetInt64(m, f, v) : r->SetInt32(m, f, static_cast<int32_t>(v));
                 }
               },
               refusal});
        }
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT32:
      case FieldDescriptor::CPPTYPE_UINT64: {
        const bool wide = f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64;
        const uint64_t hi =
            wide ? std::numeric_limits<uint64_t>::max() : std::numeric_limits<uint32_t>::max();
        for (uint64_t v : {uint64_t{0}, hi}) {  // -1 is the maximum
          std::string refusal;
          if (b.max_value && v > static_cast<uint64_t>(*b.max_value)) {
            refusal = element + ": must be <= " + std::to_string(*b.max_value) + " (" +
                      std::to_string(v) + ")";
          }
          out->push_back(
              {path, std::to_string(v),
               [v, wide](Message* m, const FieldDescriptor* f) {
                 const auto* r = m->GetReflection();
                 if (f->is_repeated()) {
                   wide ? r->AddUInt64(m, f, v) : r->AddUInt32(m, f, static_cast<uint32_t>(v));
                 } else {
                   wide ? r->SetUInt64(m, f, v) : r->SetUInt32(m, f, static_cast<uint32_t>(v));
                 }
               },
               refusal});
        }
        break;
      }
      default:  // bool, float, double: no extremes of length or range to try here
        break;
    }
  }
}

class RequestFuzzTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Store::Open("");
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    coordinator_ = std::make_unique<Coordinator>(store_.get(), SystemClock(), CoordinatorOptions{});
    ASSERT_TRUE(coordinator_->Recover().ok());
    metrics_ = std::make_unique<Metrics>(coordinator_.get());
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.token = kToken;
    auto server = CoordinatorServer::Start(coordinator_.get(), metrics_.get(), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                   grpc::InsecureChannelCredentials());
    generic_ = std::make_unique<grpc::GenericStub>(channel_);
    jobs_ = v1::JobService::NewStub(channel_);
    workers_ = v1::WorkerService::NewStub(channel_);
  }
  void TearDown() override {
    if (coordinator_) coordinator_->Shutdown();
    if (server_) server_->Shutdown(1000);
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", std::string("Bearer ") + kToken);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return ctx;
  }

  std::string Submit(const std::string& spec) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(spec);
    v1::SubmitJobResponse resp;
    const grpc::Status s = jobs_->SubmitJob(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.job().id();
  }

  v1::RegisterResponse Register(const std::string& name) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    v1::RegisterResponse resp;
    const grpc::Status s = workers_->Register(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // `get jobs` and `get workers`, every page of each.
  ::testing::AssertionResult ListingsWork() {
    v1::ListJobsRequest jreq;
    do {
      v1::ListJobsResponse page;
      const grpc::Status s = jobs_->ListJobs(Ctx().get(), jreq, &page);
      if (!s.ok()) return ::testing::AssertionFailure() << "ListJobs: " << s.error_message();
      jreq.set_page_token(page.next_page_token());
    } while (!jreq.page_token().empty());
    v1::ListWorkersRequest wreq;
    do {
      v1::ListWorkersResponse page;
      const grpc::Status s = workers_->ListWorkers(Ctx().get(), wreq, &page);
      if (!s.ok()) return ::testing::AssertionFailure() << "ListWorkers: " << s.error_message();
      wreq.set_page_token(page.next_page_token());
    } while (!wreq.page_token().empty());
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<Store> store_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> generic_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

TEST_F(RequestFuzzTest, EveryFieldOfEveryRpcAtItsExtremes) {
  // A job no fuzz worker can run (they have no CUDA device), so it stays PENDING throughout, and
  // a finished one for the calls that end only on a finished job (WatchJob, Logs).
  const std::string pending = Submit("name: fuzz\nworld_size: 1\nbackend: nccl\n");
  const std::string finished = Submit("name: fuzz-done\nworld_size: 1\nbackend: nccl\n");
  {
    v1::CancelJobRequest req;
    req.set_job_id(finished);
    v1::Job job;
    ASSERT_TRUE(jobs_->CancelJob(Ctx().get(), req, &job).ok());
  }

  // A valid request of each type, which each case changes in one field.
  const auto base = [&](const Descriptor* d) -> std::unique_ptr<Message> {
    std::unique_ptr<Message> m(
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(d)->New());
    const std::string type = d->name();
    const auto set = [&](const char* field, const std::string& value) {
      m->GetReflection()->SetString(m.get(), d->FindFieldByName(field), value);
    };
    if (d->FindFieldByName("job_id")) {
      const bool ends =
          type == "WatchJobRequest" || type == "LogsRequest" || type == "CancelJobRequest";
      set("job_id", type == "DeleteJobRequest" ? "job-999999" : ends ? finished : pending);
    }
    if (d->FindFieldByName("key")) set("key", "fuzz/key");
    if (type == "SubmitJobRequest") {
      set("spec_yaml", "name: fuzz-submit\nworld_size: 1\nbackend: nccl\n");
      set("idempotency_key", "fuzz-key");
    } else if (type == "RegisterRequest") {
      set("name", "fuzz-register");
      set("device", "cpu");
    } else if (type == "UpdatePolicyRequest") {
      auto* req = static_cast<v1::UpdatePolicyRequest*>(m.get());
      req->add_patches()->set_layer("*");
      req->mutable_patches(0)->set_format(v1::FORMAT_FP8_E5M2);
    } else if (type == "LeaveRequest" || type == "WorkerMessage") {
      // A fresh generation each time: a Leave that succeeds fences it.
      const v1::RegisterResponse r = Register("fuzz-session");
      set("worker_id", r.worker_id());
      set("session_secret", r.session_secret());
      m->GetReflection()->SetUInt64(m.get(), d->FindFieldByName("generation"), r.generation());
      if (type == "WorkerMessage") {
        static_cast<v1::WorkerMessage*>(m.get())->mutable_heartbeat()->set_unix_ms(1);
      }
    }
    return m;
  };

  const google::protobuf::FileDescriptor* file = v1::Job::descriptor()->file();
  int cases = 0, refused = 0;
  std::map<std::string, int> by_code;
  for (int si = 0; si < file->service_count(); ++si) {
    const auto* service = file->service(si);
    // HookService is the worker's, served on a job's Unix socket (the worker applies the same
    // bounds to HookMessage: BoundsTest).
    if (service->name() == "HookService") continue;
    for (int mi = 0; mi < service->method_count(); ++mi) {
      const MethodDescriptor* method = service->method(mi);
      const std::string rpc = "/" + service->full_name() + "/" + method->name();
      std::vector<Case> generated;
      Generate(method->input_type(), {}, &generated);
      ASSERT_FALSE(generated.empty() && method->input_type()->field_count() > 0) << rpc;
      for (const Case& c : generated) {
        std::unique_ptr<Message> request = base(method->input_type());
        c.set(Parent(request.get(), c.path), c.path.chain.back());
        std::string bytes;
        ASSERT_TRUE(request->SerializeToString(&bytes));
        OneShot call(generic_.get(), rpc, bytes);
        const Outcome o = call.Wait();
        const std::string label = rpc + " " + c.path.Name() + " = " + c.what;
        ++cases;
        ++by_code[absl::StatusCodeToString(static_cast<absl::StatusCode>(o.status.error_code()))];
        if (!c.expected_refusal.empty()) {
          ++refused;
          EXPECT_EQ(o.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
              << label << ": " << Cut(o.status.error_message());
          EXPECT_NE(o.status.error_message().find(c.expected_refusal), std::string::npos)
              << label << ": expected '" << c.expected_refusal << "', got '"
              << Cut(o.status.error_message()) << "'";
        } else if (o.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                   o.status.error_code() == grpc::StatusCode::OUT_OF_RANGE) {
          // Within the edge's bounds but refused by the handler: the answer names the field (or,
          // for a nested one, the field of the request that holds it).
          // A spec's errors name the document's own paths ("spec.world_size").
          const std::string field =
              c.path.chain.front()->name() == "spec_yaml" ? "spec" : c.path.chain.front()->name();
          EXPECT_NE(o.status.error_message().find(field), std::string::npos)
              << label << ": " << Cut(o.status.error_message());
        }
        EXPECT_NE(o.status.error_code(), grpc::StatusCode::INTERNAL)
            << label << ": " << Cut(o.status.error_message());
        EXPECT_NE(o.status.error_code(), grpc::StatusCode::UNAVAILABLE)
            << label << ": " << Cut(o.status.error_message());
        ASSERT_TRUE(ListingsWork()) << "after " << label;
      }
    }
  }
  std::string codes;
  for (const auto& [code, n] : by_code) codes += " " + code + ":" + std::to_string(n);
  std::printf("%d cases, %d refused at the edge by the bounds table; by code%s\n", cases, refused,
              codes.c_str());
  // Every RPC the coordinator serves was reached (a generated suite that generated nothing would
  // pass vacuously).
  EXPECT_GT(cases, 200);
}

}  // namespace
}  // namespace geofp8::coordinator
