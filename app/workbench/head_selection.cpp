#include "head_selection.h"

#include <QUndoCommand>
#include <QUndoStack>
#include <algorithm>

namespace hh::workbench {

// Replaces the set; undo restores the previous one.
class SetHeadsCommand : public QUndoCommand {
 public:
  SetHeadsCommand(HeadSelection* sel, std::set<HeadRef> before, std::set<HeadRef> after, const QString& text)
      : QUndoCommand(text), sel_(sel), before_(std::move(before)), after_(std::move(after)) {}
  void redo() override { sel_->apply(after_); }
  void undo() override { sel_->apply(before_); }

 private:
  HeadSelection* sel_;
  std::set<HeadRef> before_, after_;
};

HeadSelection::HeadSelection(QObject* parent) : QObject(parent), undo_(new QUndoStack(this)) {}

void HeadSelection::setShape(int layers, int query_heads) {
  layers_ = std::max(0, layers);
  query_heads_ = std::max(0, query_heads);
  undo_->clear();
  apply({});
}

bool HeadSelection::inGrid(const HeadRef& h) const {
  return h.first >= 0 && h.first < layers_ && h.second >= 0 && h.second < query_heads_;
}

void HeadSelection::toggle(int layer, int head) {
  const HeadRef h{layer, head};
  if (!inGrid(h)) return;
  std::set<HeadRef> next = fa_;
  const bool was = next.erase(h) > 0;
  if (!was) next.insert(h);
  undo_->push(new SetHeadsCommand(this, fa_, std::move(next),
                                  tr("%1 head %2:%3").arg(was ? tr("Linear attention for") : tr("Full attention for"))
                                      .arg(layer)
                                      .arg(head)));
}

void HeadSelection::replace(const std::set<HeadRef>& heads, const QString& description) {
  std::set<HeadRef> next;
  for (const HeadRef& h : heads)
    if (inGrid(h)) next.insert(h);
  if (next == fa_) return;
  undo_->push(new SetHeadsCommand(this, fa_, std::move(next), description));
}

void HeadSelection::apply(const std::set<HeadRef>& heads) {
  fa_ = heads;
  Q_EMIT changed();
}

}  // namespace hh::workbench
