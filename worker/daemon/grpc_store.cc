// RendezvousService-backed Store (see grpc_store.h): each operation is one RPC, retried while
// the coordinator is briefly unreachable, and every failure names the key.
#include "worker/daemon/grpc_store.h"

#include <thread>

#include "kernels/common/check.h"

namespace geofp8::worker {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// Runs call(remaining) until it returns something other than UNAVAILABLE or the deadline
// passes. `call` gets the time left so waits shrink with each retry.
template <typename Call>
grpc::Status WithRetry(Clock::time_point deadline, Call call) {
  auto backoff = milliseconds(50);
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    grpc::Status s = call(std::max(left, milliseconds(1)));
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || Clock::now() + backoff >= deadline) {
      return s;
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, milliseconds(1000));
  }
}

// Extra deadline on top of a server-side wait, so the server's DEADLINE_EXCEEDED (which names
// the key) arrives before the client gives up.
constexpr milliseconds kWaitSlack{5000};

}  // namespace

GrpcStore::GrpcStore(std::shared_ptr<Connection> connection, std::string job_id, std::string prefix)
    : connection_(std::move(connection)),
      stub_(v1::RendezvousService::NewStub(connection_->channel())),
      job_id_(std::move(job_id)),
      prefix_(std::move(prefix)) {
  GEOFP8_CHECK(!job_id_.empty(), "rendezvous store: job_id must not be empty");
}

void GrpcStore::Set(const std::string& key, const std::vector<uint8_t>& value) {
  v1::KvSetRequest req;
  req.set_job_id(job_id_);
  req.set_key(Scoped(key));
  req.set_value(std::string(value.begin(), value.end()));
  grpc::Status s = WithRetry(Clock::now() + rpc_timeout_, [&](milliseconds left) {
    v1::KvSetResponse resp;
    return stub_->Set(connection_->Context(left).get(), req, &resp);
  });
  GEOFP8_CHECK(s.ok(), "rendezvous store: set '", Scoped(key), "' of job ", job_id_, " at ",
               connection_->address(), " failed: ", DescribeStatus(s));
}

std::vector<uint8_t> GrpcStore::Get(const std::string& key, milliseconds timeout) {
  v1::KvGetRequest req;
  req.set_job_id(job_id_);
  req.set_key(Scoped(key));
  const auto deadline = Clock::now() + timeout;
  v1::KvGetResponse resp;
  grpc::Status s = WithRetry(deadline, [&](milliseconds left) {
    req.set_wait_ms(std::max<int64_t>(left.count(), 1));
    return stub_->Get(connection_->Context(left + kWaitSlack).get(), req, &resp);
  });
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    GEOFP8_FAIL_STORE_TIMEOUT("store: timed out after ", timeout.count(), " ms waiting for key '",
                              Scoped(key), "' of job ", job_id_, " (", DescribeStatus(s), ")");
  }
  GEOFP8_CHECK(s.ok(), "rendezvous store: get '", Scoped(key), "' of job ", job_id_, " at ",
               connection_->address(), " failed: ", DescribeStatus(s));
  const std::string& v = resp.value();
  return std::vector<uint8_t>(v.begin(), v.end());
}

void GrpcStore::Wait(const std::vector<std::string>& keys, milliseconds timeout) {
  if (keys.empty()) return;
  v1::KvWaitRequest req;
  req.set_job_id(job_id_);
  for (const auto& k : keys) req.add_keys(Scoped(k));
  const auto deadline = Clock::now() + timeout;
  grpc::Status s = WithRetry(deadline, [&](milliseconds left) {
    req.set_timeout_ms(std::max<int64_t>(left.count(), 1));
    v1::KvWaitResponse resp;
    return stub_->Wait(connection_->Context(left + kWaitSlack).get(), req, &resp);
  });
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    GEOFP8_FAIL_STORE_TIMEOUT("store: timed out after ", timeout.count(),
                              " ms waiting for keys of job ", job_id_, " (", DescribeStatus(s),
                              ")");
  }
  GEOFP8_CHECK(s.ok(), "rendezvous store: wait for ", keys.size(), " keys (first '",
               Scoped(keys[0]), "') of job ", job_id_, " at ", connection_->address(),
               " failed: ", DescribeStatus(s));
}

int64_t GrpcStore::Add(const std::string& key, int64_t delta) {
  v1::KvAddRequest req;
  req.set_job_id(job_id_);
  req.set_key(Scoped(key));
  req.set_delta(delta);
  v1::KvAddResponse resp;
  // Not retried: an add that reached the server but lost its reply would count twice.
  grpc::Status s = stub_->Add(connection_->Context(rpc_timeout_).get(), req, &resp);
  GEOFP8_CHECK(s.ok(), "rendezvous store: add to '", Scoped(key), "' of job ", job_id_, " at ",
               connection_->address(), " failed: ", DescribeStatus(s));
  return resp.value();
}

}  // namespace geofp8::worker
