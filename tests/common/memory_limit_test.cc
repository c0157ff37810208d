// CgroupMemoryLimit over cgroup trees laid out in a temporary directory, as
// Kubernetes and Docker mount them (v2 unified, v1 memory controller).
#include "common/memory_limit.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            ("cgroup-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  void Write(const std::string& relative, const std::string& text) {
    const std::filesystem::path path = root_ / relative;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }

  std::optional<CgroupLimit> Limit(const std::string& proc_cgroup) {
    return CgroupMemoryLimit(proc_cgroup, root_.string());
  }

  std::filesystem::path root_;
};

TEST_F(MemoryLimitTest, V2TakesTheLeastLimitOfTheCgroupAndItsAncestors) {
  Write("kubepods/memory.max", "max\n");
  Write("kubepods/pod1/memory.max", "2147483648\n");
  Write("kubepods/pod1/ctr/memory.max", "max\n");
  auto limit = Limit("0::/kubepods/pod1/ctr\n");
  ASSERT_TRUE(limit.has_value());
  EXPECT_EQ(limit->bytes, int64_t{2} << 30);
  EXPECT_EQ(limit->file, (root_ / "kubepods/pod1/memory.max").string());
}

TEST_F(MemoryLimitTest, V2InsideAContainerReadsTheMountRoot) {
  // A cgroup namespace shows "/"; without one the path is the host's, which the
  // container does not see: its own cgroup is mounted at the root.
  Write("memory.max", "1073741824\n");
  EXPECT_EQ(Limit("0::/\n")->bytes, int64_t{1} << 30);
  EXPECT_EQ(Limit("0::/kubepods/pod2/ctr\n")->bytes, int64_t{1} << 30);
}

TEST_F(MemoryLimitTest, V1UsesTheMemoryControllersHierarchy) {
  Write("memory/memory.limit_in_bytes", "9223372036854771712\n");  // the root: no limit
  Write("memory/docker/abc/memory.limit_in_bytes", "536870912\n");
  Write("memory.max", "1073741824\n");  // a v2 file that must not be read here
  auto limit = Limit("5:cpuacct,cpu:/\n4:memory:/docker/abc\n0::/\n");
  ASSERT_TRUE(limit.has_value());
  EXPECT_EQ(limit->bytes, int64_t{512} << 20);
}

TEST_F(MemoryLimitTest, NoLimitIsNullopt) {
  Write("memory.max", "max\n");
  EXPECT_FALSE(Limit("0::/\n").has_value());
  Write("memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_FALSE(Limit("4:memory:/\n").has_value());
  EXPECT_FALSE(Limit("4:memory:/not/mounted\n").has_value());
  EXPECT_FALSE(Limit("").has_value());
  EXPECT_FALSE(Limit("garbage\n").has_value());
}

TEST(PhysicalMemoryTest, ReadsMemTotal) {
  auto bytes = PhysicalMemoryBytes();
  ASSERT_TRUE(bytes.has_value());
  EXPECT_GT(*bytes, int64_t{64} << 20);
}

}  // namespace
}  // namespace kvcache
