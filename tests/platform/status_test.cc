// GEOFP8_RETURN_IF_ERROR and GEOFP8_ASSIGN_OR_RETURN: errors pass up unchanged (code, message,
// payload), values move, and the expression is evaluated once.
#include "platform/common/status.h"

#include <memory>
#include <string>

#include "absl/strings/cord.h"
#include "gtest/gtest.h"

namespace geofp8 {
namespace {

absl::Status Fails() {
  absl::Status s = absl::DataLossError("seal says 7 jobs, database has 3");
  s.SetPayload("type.geofp8/test", absl::Cord("x"));
  return s;
}

absl::StatusOr<std::unique_ptr<int>> Value(int v) { return std::make_unique<int>(v); }
absl::StatusOr<std::unique_ptr<int>> NoValue() { return absl::NotFoundError("job job-000009"); }

absl::Status PassesStatusUp(bool fail, int* reached) {
  GEOFP8_RETURN_IF_ERROR(fail ? Fails() : absl::OkStatus());
  ++*reached;
  return absl::OkStatus();
}

absl::StatusOr<int> Sum(bool fail) {
  GEOFP8_ASSIGN_OR_RETURN(std::unique_ptr<int> a, Value(2));
  GEOFP8_ASSIGN_OR_RETURN(auto b, fail ? NoValue() : Value(3));
  return *a + *b;
}

TEST(StatusMacros, ReturnIfErrorPassesTheErrorUpUnchanged) {
  int reached = 0;
  absl::Status s = PassesStatusUp(true, &reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "seal says 7 jobs, database has 3");
  EXPECT_EQ(s.GetPayload("type.geofp8/test"), absl::Cord("x"));
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(PassesStatusUp(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, ReturnIfErrorTakesAStatusOrAndEvaluatesOnce) {
  int calls = 0;
  auto f = [&]() -> absl::Status {
    GEOFP8_RETURN_IF_ERROR((++calls, NoValue()));
    return absl::OkStatus();
  };
  EXPECT_EQ(f().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(calls, 1);
}

TEST(StatusMacros, AssignOrReturnMovesTheValueOrReturnsTheError) {
  absl::StatusOr<int> ok = Sum(false);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 5);
  absl::StatusOr<int> bad = Sum(true);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bad.status().message(), "job job-000009");
}

TEST(StatusMacros, AssignOrReturnAssignsToAnExistingVariable) {
  auto f = [](bool fail) -> absl::StatusOr<int> {
    std::unique_ptr<int> v;
    GEOFP8_ASSIGN_OR_RETURN(v, fail ? NoValue() : Value(7));
    return *v;
  };
  EXPECT_EQ(*f(false), 7);
  EXPECT_FALSE(f(true).ok());
}

}  // namespace
}  // namespace geofp8
