// The coordinator's secret comparison (server/coordinator/secrets.h), which checks the bearer
// token and the workers' session secrets: equal only when every byte and the length agree.
#include "server/coordinator/secrets.h"

#include <gtest/gtest.h>

#include <string>

namespace geofp8::coordinator {
namespace {

TEST(SecretEqualsTest, OnlyTheWholeValueMatches) {
  const std::string token = "Bearer s3cret";
  EXPECT_TRUE(SecretEquals(token, "Bearer s3cret"));
  EXPECT_FALSE(SecretEquals(token, ""));                                  // empty
  EXPECT_FALSE(SecretEquals(token, "Bearer "));                           // empty token
  EXPECT_FALSE(SecretEquals(token, "Bearer s3cre"));                      // truncated
  EXPECT_FALSE(SecretEquals(token, "Bearer s3cret1"));                    // extended
  EXPECT_FALSE(SecretEquals(token, std::string("Bearer s3cret\0", 14)));  // extended by a NUL
  EXPECT_FALSE(SecretEquals(token, "Bearer S3CRET"));                     // differently cased
  EXPECT_FALSE(SecretEquals(token, "Bearer s3creT"));                     // the last byte's case
  EXPECT_FALSE(SecretEquals(token, "bearer s3cret"));                     // the first byte's case
  EXPECT_FALSE(SecretEquals(token, "Bearer s3cres"));                     // the last byte
  EXPECT_FALSE(SecretEquals("", "x"));
  EXPECT_TRUE(SecretEquals("", ""));
}

}  // namespace
}  // namespace geofp8::coordinator
