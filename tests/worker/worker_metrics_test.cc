// WorkerMetrics on its own: per-job labels, whole bytes, results, and what is left of a job once
// it has ended (its gauges go; its counters stay for the last kKeptJobs jobs).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "worker/daemon/metrics.h"

namespace geofp8::worker {
namespace {

bool Has(const std::string& text, const std::string& line) {
  return text.find(line) != std::string::npos;
}

TEST(WorkerMetricsTest, CountersAreThereFromTheStart) {
  WorkerMetrics m;
  const std::string t = m.Render();
  for (const char* r : {"succeeded", "failed", "cancelled", "stopped"}) {
    EXPECT_TRUE(Has(t, "geofp8_worker_jobs_total{result=\"" + std::string(r) + "\"} 0")) << t;
  }
  EXPECT_TRUE(Has(t, "geofp8_worker_errors_total{kind=\"session_lost\"} 0")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_steps_total 0")) << t;
  EXPECT_TRUE(Has(t, "geofp8_exchange_seconds_count 0")) << t;
  EXPECT_TRUE(Has(t, "geofp8_geometry_refresh_seconds_count 0")) << t;
  EXPECT_TRUE(Has(t, "geofp8_build_info{git_commit=\"")) << t;
  EXPECT_TRUE(Has(t, "process_resident_memory_bytes ")) << t;
}

TEST(WorkerMetricsTest, JobSeriesCarryTheJobAndWholeBytes) {
  WorkerMetrics m;
  m.JobStarted("a", 0, 2);
  m.Step(0, 2.5, 1000, {0.1, 0.01, 0.004}, false);
  m.ValidationLoss(0, 2.75);
  // 0.4 + 0.4 + 0.4 = 1.2 bytes: the counter holds the whole byte, the 0.2 is carried.
  for (int i = 0; i < 3; ++i) m.LayerBytes("l0", "fp8_e4m3", 0.4);
  m.LayerError("l0", 0.01);
  m.Refresh("l0", 0.2);
  m.ProbeGain("l0", "shadow", 1.5);
  m.ProbeGain("l0", "deployed", 2.0);  // the other basis' series goes
  std::string t = m.Render();
  EXPECT_TRUE(
      Has(t, "geofp8_exchange_bytes_total{format=\"fp8_e4m3\",job_id=\"a\",layer=\"l0\"} 1\n"))
      << t;
  EXPECT_TRUE(Has(t, "geofp8_quantization_rel_error{job_id=\"a\",layer=\"l0\"} 0.01")) << t;
  EXPECT_TRUE(Has(t, "geofp8_geometry_drift{job_id=\"a\",layer=\"l0\"} 0.2")) << t;
  EXPECT_TRUE(Has(t, "geofp8_geometry_refreshes_total{job_id=\"a\",layer=\"l0\"} 1")) << t;
  EXPECT_TRUE(Has(t, "geofp8_geometry_probe_gain{basis=\"deployed\",job_id=\"a\",layer=\"l0\"} 2"))
      << t;
  EXPECT_FALSE(Has(t, "basis=\"shadow\"")) << t;
  EXPECT_TRUE(Has(t, "geofp8_geometry_refresh_seconds_sum 0.004\n")) << t;
  EXPECT_TRUE(Has(t, "geofp8_exchange_seconds_sum 0.01\n")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_step{job_id=\"a\"} 0")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_val_loss{job_id=\"a\"} 2.75")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_val_step{job_id=\"a\"} 0")) << t;
  m.LayerBytes("l0", "fp8_e4m3", 0.8);  // 2.0 exactly
  EXPECT_TRUE(Has(m.Render(), "job_id=\"a\",layer=\"l0\"} 2\n"));

  m.JobEnded(false, true, /*cancelled=*/true);
  t = m.Render();
  EXPECT_TRUE(Has(t, "geofp8_worker_jobs_total{result=\"cancelled\"} 1")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_jobs_total{result=\"failed\"} 0")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_errors_total{kind=\"job_failed\"} 0")) << t;
  for (const char* gone : {"geofp8_worker_step{", "geofp8_worker_loss{", "geofp8_worker_val_loss{",
                           "geofp8_worker_val_step{", "geofp8_worker_tokens_per_second{",
                           "geofp8_quantization_rel_error{", "geofp8_geometry_drift{",
                           "geofp8_geometry_probe_gain{"}) {
    EXPECT_FALSE(Has(t, gone)) << gone << "\n" << t;
  }
  EXPECT_TRUE(Has(t, "geofp8_exchange_bytes_total{format=\"fp8_e4m3\",job_id=\"a\"")) << t;
  // Updates between jobs have no job to belong to.
  m.LayerError("l0", 0.5);
  m.ValidationLoss(3, 1.0);
  EXPECT_FALSE(Has(m.Render(), "geofp8_quantization_rel_error{"));
  EXPECT_FALSE(Has(m.Render(), "geofp8_worker_val_loss{"));
}

TEST(WorkerMetricsTest, NoiseScaleHasNoSampleWhileUndefined) {
  WorkerMetrics m;
  m.JobStarted("a", 0, 2);
  m.GradientNoiseScale(NAN);  // one rank, or the first steps
  EXPECT_FALSE(Has(m.Render(), "geofp8_gradient_noise_scale{")) << m.Render();
  m.GradientNoiseScale(1234.5);
  EXPECT_TRUE(Has(m.Render(), "geofp8_gradient_noise_scale{job_id=\"a\"} 1234.5")) << m.Render();
  for (double undefined : {-3.0, double(NAN), double(INFINITY), 0.0}) {
    m.GradientNoiseScale(undefined);
    EXPECT_FALSE(Has(m.Render(), "geofp8_gradient_noise_scale{")) << undefined << m.Render();
  }
  m.GradientNoiseScale(77);
  m.JobEnded(true, false, false);
  EXPECT_FALSE(Has(m.Render(), "geofp8_gradient_noise_scale{")) << m.Render();
}

TEST(WorkerMetricsTest, ResultsAndTheBoundOnKeptJobs) {
  WorkerMetrics m;
  const int jobs = int(WorkerMetrics::kKeptJobs) + 2;
  for (int j = 0; j < jobs; ++j) {
    m.JobStarted("j" + std::to_string(j), 0, 1);
    m.LayerBytes("l0", "bf16", 10);
    if (j == 0)
      m.JobEnded(true, false, false);
    else if (j == 1)
      m.JobEnded(false, false, false);
    else
      m.JobEnded(false, true, false);
  }
  const std::string t = m.Render();
  EXPECT_TRUE(Has(t, "geofp8_worker_jobs_total{result=\"succeeded\"} 1")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_jobs_total{result=\"failed\"} 1")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_errors_total{kind=\"job_failed\"} 1")) << t;
  EXPECT_TRUE(Has(t, "geofp8_worker_jobs_total{result=\"stopped\"} " + std::to_string(jobs - 2)))
      << t;
  // The two oldest jobs' counters are gone; the last kKeptJobs remain.
  EXPECT_FALSE(Has(t, "job_id=\"j0\"")) << t;
  EXPECT_FALSE(Has(t, "job_id=\"j1\"")) << t;
  for (int j = 2; j < jobs; ++j) EXPECT_TRUE(Has(t, "job_id=\"j" + std::to_string(j) + "\"")) << t;
}

}  // namespace
}  // namespace geofp8::worker
