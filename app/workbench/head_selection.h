#pragma once
// The full-attention head set being edited, shared by the views that show or change it (Heads now,
// Selection later), with undo: every change is one command on an undo stack, so a click that toggles
// a head and a strategy that replaces the whole set undo the same way.
#include <QObject>
#include <QString>
#include <set>
#include <utility>
#include <vector>

class QUndoStack;

namespace hh::workbench {

using HeadRef = std::pair<int, int>;  // (layer, query head)

class HeadSelection : public QObject {
  Q_OBJECT

 public:
  explicit HeadSelection(QObject* parent = nullptr);

  // The grid the heads live in; a new shape clears the set and the history.
  void setShape(int layers, int query_heads);
  int layers() const { return layers_; }
  int queryHeads() const { return query_heads_; }

  const std::set<HeadRef>& faHeads() const { return fa_; }
  bool isFullAttention(int layer, int head) const { return fa_.count({layer, head}) > 0; }
  int count() const { return static_cast<int>(fa_.size()); }
  std::vector<HeadRef> sorted() const { return {fa_.begin(), fa_.end()}; }

  // Undoable edits. Heads outside the grid are ignored; an edit that changes nothing pushes nothing.
  void toggle(int layer, int head);
  void replace(const std::set<HeadRef>& heads, const QString& description);

  QUndoStack* undoStack() const { return undo_; }

 Q_SIGNALS:
  void changed();

 private:
  friend class SetHeadsCommand;
  void apply(const std::set<HeadRef>& heads);  // no history; emits changed()
  bool inGrid(const HeadRef& h) const;

  int layers_ = 0, query_heads_ = 0;
  std::set<HeadRef> fa_;
  QUndoStack* undo_;
};

}  // namespace hh::workbench
